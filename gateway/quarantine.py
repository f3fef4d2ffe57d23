"""Requests that killed engines, refused for a while.

A kvgate worker whose engine loop dies answers every request that was in it with 503
`engine_died` (worker/server/errors.py), and the gateway tries the next replica, as for any 5xx
before the first byte: a crash that had nothing to do with them should not fail the requests it
caught. But a request that itself kills an engine (an input the engine cannot take) would kill
each replica it is tried on, and again on each retry of its client (OpenAI's SDKs retry a 503).
So when a request's attempt ends in `engine_died` on a second replica, the gateway tries no third
(gateway/serving/retry.py) and holds the digest of its body for `--poison-ttl` seconds: that
request, and any identical one meanwhile, is answered 400 `engine_killer` without reaching a
worker. Nothing is hashed while none is held.
"""

from __future__ import annotations

import hashlib
import time

MAX_HELD = 1024  # the oldest goes first past this: a bound on memory, not a policy


class Quarantine:
    __slots__ = ("_until", "ttl")

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._until: dict[bytes, float] = {}  # digest -> until; oldest first (one ttl for all)

    def holds(self, payload: bytes) -> bool:
        """Whether a request with this body is refused now."""
        if not self._until:
            return False
        now = time.monotonic()
        while self._until and next(iter(self._until.values())) <= now:
            del self._until[next(iter(self._until))]
        return _digest(payload) in self._until

    def hold(self, payload: bytes) -> None:
        if self.ttl <= 0:
            return
        key = _digest(payload)
        self._until.pop(key, None)  # to the back: it expires last
        if len(self._until) >= MAX_HELD:
            del self._until[next(iter(self._until))]
        self._until[key] = time.monotonic() + self.ttl


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()
