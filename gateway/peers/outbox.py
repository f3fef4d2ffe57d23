"""PeerOutbox: the request path's side of the peers. Appending never blocks and never waits on a
socket: a bounded queue the sender task drains; when it is full the change is dropped and
counted (a peer then misses one placement, as a gateway without peers would)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from itertools import count

from cachekey.types import BlockKey
from gateway.peers.wire import DISCARDED, PLACED, RELEASED, SHOWN, Placement


class PeerOutbox:
    def __init__(self, max_queue: int = 10_000) -> None:
        self.queue: deque[Placement] = deque()
        self.max_queue = max_queue
        self.dropped = 0
        self.ready = asyncio.Event()
        self._ids = count(1)

    def placed(self, replica: str, keys: Sequence[BlockKey], tokens: int) -> int:
        """A request was routed to `replica` and will cache `keys` there, prefilling `tokens`
        uncached prompt tokens: its placement id."""
        pid = next(self._ids)
        self._put(Placement(PLACED, pid, replica, list(keys), tokens))
        return pid

    def shown(self, pid: int) -> None:
        self._put(Placement(SHOWN, pid))

    def ended(self, pid: int, refused: bool) -> None:
        self._put(Placement(DISCARDED if refused else RELEASED, pid))

    def _put(self, p: Placement) -> None:
        if len(self.queue) >= self.max_queue:
            self.dropped += 1
            return
        self.queue.append(p)
        self.ready.set()

    def take(self) -> list[Placement]:
        q, self.queue = self.queue, deque()
        self.ready.clear()
        return list(q)
