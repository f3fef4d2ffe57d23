"""ReplayClient: fetches buffered KV-event batches from a worker's replay ROUTER over a DEALER.

One request at a time, from the subscriber's own task. The socket is kept between requests (the
subscriber asks after every idle interval) and rebuilt after a request that got no whole answer,
so that a late reply is never read as the answer to the next request.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import KW_ONLY, dataclass, field

import zmq
import zmq.asyncio

from cachekey.events import DecodeError, parse_replay_reply, seq_bytes
from cachekey.worker_auth import CurveKeys

log = logging.getLogger(__name__)

# Tail checks in a row that recover batches before the gateway says the live stream is missing.
REPLAY_ONLY_WARN_AFTER = 3


@dataclass(slots=True)
class ReplayClient:
    ctx: zmq.asyncio.Context
    endpoint: str
    _: KW_ONLY
    ipv6: bool
    timeout: float
    name: str  # the replica, for logs
    curve: CurveKeys | None = None
    _dealer: zmq.asyncio.Socket | None = field(default=None, init=False)
    _failing: bool = field(default=False, init=False)

    async def fetch(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every buffered batch with seq >= start, oldest first; None when no whole answer came."""
        try:
            batches = await self._request(start)
        except (TimeoutError, zmq.ZMQError, DecodeError) as e:
            # Once per failure streak: an idle subscriber asks again every interval.
            level = logging.DEBUG if self._failing else logging.WARNING
            reason = str(e) or type(e).__name__
            log.log(
                level,
                "%s: replay from seq %d at %s failed: %s",
                self.name,
                start,
                self.endpoint,
                reason,
            )
            self._failing = True
            self.close()
            return None
        if self._failing:
            log.info("%s: replay at %s answers again", self.name, self.endpoint)
            self._failing = False
        return batches

    async def _request(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self._socket()
        await dealer.send_multipart([b"", seq_bytes(start)])
        batches: list[tuple[int, bytes]] = []
        while True:
            async with asyncio.timeout(self.timeout):  # not wait_for: gateway/tasks.py
                reply = await dealer.recv_multipart()
            item = parse_replay_reply(reply)
            if item is None:
                return batches
            batches.append(item)

    def close(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def _socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.IPV6, self.ipv6)
            if self.curve is not None:
                self.curve.connect(dealer)
            dealer.connect(self.endpoint)
            self._dealer = dealer
        return self._dealer


def replay_only_hint(endpoint: str | None, topic: str, checks: int, tail_s: float) -> str:
    """Why a worker's events reach the gateway only through replay, and what to change.
    `endpoint`: where its subscriber's SUB connects (None: connect mode, the central SUB)."""
    head = (
        f"its KV events reach this gateway only through replay ({checks} tail checks in a row "
        f"found batches the live stream never delivered; predictions lag its cache by up to "
        f"{tail_s:g}s meanwhile). "
    )
    if endpoint is None:
        return head + (
            f"Nothing arrives for topic {topic!r} on the SUB that --kv-events-bind binds: "
            "the worker's KV-events `endpoint` must name that address (rank r on its port + r), "
            "with this topic."
        )
    return head + (
        f"Nothing is published on {endpoint} for topic {topic!r}: "
        "vLLM binds its `endpoint` only with a wildcard host (tcp://*:PORT) and connects "
        "with any other host (then start the gateway with --kv-events-bind); or the worker's "
        "kv-events port is another one."
    )
