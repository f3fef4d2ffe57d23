"""Admission: a bounded number of in-flight requests per replica and a bounded wait queue.

A routed request takes a slot on the best-ranked replica with room; if none has room it waits
(at most `max_queue` waiters, at most `queue_timeout` seconds) for any slot among its ranked
replicas. Past either bound it is refused with `Overloaded` (a 429 with Retry-After). The only
per-request state is one waiter count, so memory stays bounded under any load.
"""

from __future__ import annotations

import asyncio
import math
import time

from gateway.config import GatewayConfig
from gateway.index import ReplicaId
from gateway.replicas import Replica


class Overloaded(Exception):
    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class Admission:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.held: dict[ReplicaId, int] = {}
        self.waiting = 0
        self._freed = asyncio.Event()

    def _try_take(self, ranked: list[Replica]) -> Replica | None:
        cap = self.config.max_inflight_per_replica
        for rep in ranked:
            n = self.held.get(rep.id, 0)
            if cap is None or n < cap:
                self.held[rep.id] = n + 1
                return rep
        return None

    async def acquire(self, ranked: list[Replica]) -> Replica:
        """A slot on the first replica in `ranked` with room; waits, or raises Overloaded."""
        rep = self._try_take(ranked)
        if rep is not None:
            return rep
        c = self.config
        retry = max(1, math.ceil(min(c.queue_timeout, 5.0)))
        if self.waiting >= c.max_queue:
            raise Overloaded(
                f"gateway overloaded: all replicas at --max-inflight-per-replica "
                f"{c.max_inflight_per_replica} and the queue is full (--max-queue {c.max_queue})",
                retry,
            )
        deadline = time.monotonic() + c.queue_timeout
        self.waiting += 1
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                freed = self._freed
                try:
                    await asyncio.wait_for(freed.wait(), left)
                except TimeoutError:
                    break
                rep = self._try_take(ranked)
                if rep is not None:
                    return rep
        finally:
            self.waiting -= 1
        raise Overloaded(
            f"gateway overloaded: no replica slot freed within --queue-timeout "
            f"{c.queue_timeout:g}s (--max-inflight-per-replica {c.max_inflight_per_replica})",
            retry,
        )

    def release(self, rep_id: ReplicaId) -> None:
        n = self.held.get(rep_id, 0) - 1
        if n > 0:
            self.held[rep_id] = n
        else:
            self.held.pop(rep_id, None)  # no entry kept for idle (or removed) replicas
        # Wake every waiter (each re-checks its own ranking); later ones wait on a fresh event.
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()
