"""Speculative entries: blocks a replica will hold because the gateway just routed a request there.

A routed request's keys are a guess about its replica until the worker's own `BlockStored`
events replace them (`confirm`). A guess counts as a hit for a later request only when the
worker would really give one:

- at once on a worker that gives a later request the blocks an earlier one is still computing
  (`WorkerInfo.defers_shared_prefill`): kvgate's scheduler defers the later request until the
  blocks it shares are cached; vLLM caches a request's blocks when it schedules it, so a later
  request hits them from then on (even in the same step);
- on any other worker, once the request's prefill has finished (its first token, or its end):
  two requests computing one prefix at once would both miss it.

A guess lives while its request is in flight and `ttl` seconds after it ends (for its events to
arrive; without events it is all the gateway knows, see docs/gateway.md). Each replica's shown
keys are kept in use order and capped at its KV-cache size when it is known: the oldest keys go
first, as the worker's own LRU would evict them.

Locking: the index's ingestion thread confirms guesses while the request path adds and settles
them. `show`, `release` and `discard` (called on a `Guess`, the handle `BlockIndex.speculate`
returns) take the index's lock; the rest run under it already.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

from cachekey.types import BlockKey


class Guess:
    """One routed request's speculative keys on one replica."""

    __slots__ = ("_entries", "bit", "capacity", "gen", "keys", "live", "shown")

    def __init__(
        self,
        entries: SpeculativeEntries,
        bit: int,
        gen: int,
        keys: list[BlockKey],
        capacity: int | None,
    ) -> None:
        self._entries = entries
        self.bit = bit
        self.gen = gen  # the bit's generation: a guess outliving its replica's slot is ignored
        self.keys = keys
        self.capacity = capacity  # the replica's KV-cache blocks, when known
        self.shown = False
        self.live = True

    # The handle's whole interface, for the request that made the guess.
    def show(self, now: float | None = None) -> None:
        """Its request's prefill finished: its keys are a hit on any worker now."""
        self._entries.show(self, now)

    def release(self, now: float | None = None) -> None:
        """Its request ended: its keys stay `ttl` seconds more (unless events confirm them)."""
        self._entries.release(self, now)

    def discard(self) -> None:
        """Its request never reached the replica: forget its keys there."""
        self._entries.discard(self)


class SpeculativeEntries:
    def __init__(self, ttl: float, lock: threading.Lock) -> None:
        self.ttl = ttl
        self._lock = lock
        self.mask: dict[BlockKey, int] = {}  # key -> bits of replicas guessed to hold it
        self._refs: dict[tuple[BlockKey, int], int] = {}  # in-flight guesses showing a key
        self._until: dict[tuple[BlockKey, int], float] = {}  # expiry once no guess is in flight
        self._expiry: deque[tuple[float, BlockKey, int]] = deque()
        self._order: dict[int, dict[BlockKey, None]] = {}  # per bit: shown keys, oldest first
        self._gen: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.mask)

    def add(
        self,
        bit: int,
        keys: Sequence[BlockKey],
        held: dict[BlockKey, int],
        show: bool,
        capacity: int | None,
        now: float,
    ) -> Guess:
        """Guess that `bit`'s replica will hold `keys` (those it does not hold already);
        shown at once when its worker defers."""
        keys = [k for k in keys if not held.get(k, 0) & bit]
        guess = Guess(self, bit, self._gen.get(bit, 0), keys, capacity)
        if show:
            self._show(guess, now)
        return guess

    def show(self, guess: Guess, now: float | None = None) -> None:
        """The guessed request's prefill finished: its keys are a hit on any worker now."""
        with self._lock:
            self._show(guess, time.monotonic() if now is None else now)

    def _show(self, guess: Guess, now: float) -> None:
        if guess.shown or not guess.live or guess.gen != self._gen.get(guess.bit, 0):
            return
        guess.shown = True
        bit, mask, refs = guess.bit, self.mask, self._refs
        order = self._order.setdefault(bit, {})
        for key in guess.keys:
            mask[key] = mask.get(key, 0) | bit
            refs[(key, bit)] = refs.get((key, bit), 0) + 1
            order.pop(key, None)  # pop + insert: the key becomes the newest
            order[key] = None
        if guess.capacity is not None and len(order) > guess.capacity:
            self._evict(bit, order, len(order) - guess.capacity)
        self.expire(now)

    def release(self, guess: Guess, now: float | None = None) -> None:
        """The request ended: its keys stay `ttl` seconds more (unless events confirm them)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._show(guess, now)
            guess.live = False
            if not guess.shown or guess.gen != self._gen.get(guess.bit, 0):
                return
            expiry = now + self.ttl
            for key in guess.keys:
                if self._unref(key, guess.bit):
                    self._until[(key, guess.bit)] = expiry
                    self._expiry.append((expiry, key, guess.bit))

    def discard(self, guess: Guess) -> None:
        """The request never reached the replica (it moved on): forget its keys there, unless
        another request's guess still shows them."""
        with self._lock:
            was_shown, guess.live = guess.shown, False
            if not was_shown or guess.gen != self._gen.get(guess.bit, 0):
                return
            for key in guess.keys:
                if self._unref(key, guess.bit) and (key, guess.bit) not in self._until:
                    self.confirm(key, guess.bit)

    def _unref(self, key: BlockKey, bit: int) -> bool:
        """One in-flight guess less on (key, bit); True when it was the last."""
        n = self._refs.get((key, bit))
        if n is None:
            return False  # confirmed or evicted meanwhile
        if n > 1:
            self._refs[(key, bit)] = n - 1
            return False
        del self._refs[(key, bit)]
        return True

    def confirm(self, key: BlockKey, bit: int) -> None:
        """A real event about (key, bit) arrived: it replaces the guess."""
        mask = self.mask.get(key, 0)
        if not mask & bit:
            return
        if mask & ~bit:
            self.mask[key] = mask & ~bit
        else:
            del self.mask[key]  # an empty entry would stay forever
        self._refs.pop((key, bit), None)
        self._until.pop((key, bit), None)
        order = self._order.get(bit)
        if order is not None:
            order.pop(key, None)

    def drop(self, bit: int) -> None:
        """Forget every guess about a replica (its slot may go to another replica next)."""
        self._gen[bit] = self._gen.get(bit, 0) + 1
        for key in list(self._order.pop(bit, {})):
            self.confirm(key, bit)

    def due(self, now: float) -> bool:
        return bool(self._expiry) and self._expiry[0][0] <= now

    def expire(self, now: float) -> None:
        q = self._expiry
        while q and q[0][0] <= now:
            expiry, key, bit = q.popleft()
            if self._until.get((key, bit)) != expiry:
                continue
            del self._until[(key, bit)]
            if (key, bit) not in self._refs:  # else a request in flight shows it again
                self.confirm(key, bit)

    def _evict(self, bit: int, order: dict[BlockKey, None], n: int) -> None:
        """Drop the `n` oldest keys no request in flight uses (the worker's LRU frees those)."""
        refs, victims = self._refs, []
        for key in order:  # oldest first; stops as soon as it has enough
            if (key, bit) not in refs:
                victims.append(key)
                if len(victims) == n:
                    break
        for key in victims:
            self.confirm(key, bit)
