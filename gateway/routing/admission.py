"""Admission: bounded requests per replica, a bounded wait queue and a bounded render queue.

`Replica.in_flight` is the one in-flight counter; admission moves it. A request is admitted
before any render work: it needs a free slot among its candidate replicas that no other
admitted-but-not-yet-placed request has claimed (`pending`). Once ranked it is placed on the
best-ranked replica with room; a retry moves its slot to the next replica with room. Past the
queue (`max_queue` waiters, `queue_timeout` seconds) a request gets `Overloaded`, a 429 with
Retry-After. The only per-request state is a few counters, so memory stays bounded under any load.

With peer gateways (`shares`, gateway/peers/shares.py) a slot must also be within this gateway's
share of the replica's cap, so the cap holds for the gateways together.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gateway.config import GatewayConfig
from gateway.errors import Overloaded
from gateway.fleet.replica import Replica
from gateway.peers.shares import PeerShares, Shares, room

T = TypeVar("T")


class Admission:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.cap = config.max_inflight_per_replica
        self.pending = 0  # admitted, not yet placed on a replica
        self.waiting = 0
        self.held = 0  # slots this gateway's requests hold (Replica.in_flight adds the peers')
        self.shares: PeerShares | None = None  # with peers: this gateway's share of each cap
        self._freed = asyncio.Event()

    def demand(self) -> int:
        """Requests holding a slot or waiting for one (what the shares are split by)."""
        return self.held + self.pending + self.waiting

    def _split(self) -> Shares | None:
        return None if self.shares is None else self.shares.split()

    def _has_room(self, candidates: list[Replica]) -> bool:
        cap = self.cap
        if cap is None:
            return True
        split, free = self._split(), 0
        for r in candidates:
            n = cap - r.in_flight if split is None else _room(split, cap, r)
            if n > 0:
                free += n
                if free > self.pending:
                    return True
        return False

    def _take(self, ranked: list[Replica]) -> Replica | None:
        cap, split = self.cap, self._split()
        for rep in ranked:
            room_there = cap is None or (
                rep.in_flight < cap if split is None else _room(split, cap, rep) > 0
            )
            if room_there:
                rep.in_flight += 1
                self.held += 1
                return rep
        return None

    async def admit(self, candidates: list[Replica]) -> None:
        """Claim a free slot among `candidates` (placed later by `place`); wait or raise."""
        if not self._has_room(candidates):
            await self._wait_for(lambda: self._has_room(candidates))
        self.pending += 1

    async def place(self, ranked: list[Replica]) -> Replica:
        """Turn the claim into a slot on the best-ranked replica with room."""
        self.pending -= 1
        rep = self._take(ranked)
        if rep is None:  # requests for other candidates took the room meanwhile
            rep = await self._wait_for(lambda: self._take(ranked))
        return rep

    def withdraw(self) -> None:
        """Give up a claim that was never placed (the request failed before routing)."""
        self.pending -= 1
        self._wake()

    def move(self, rep: Replica, ranked: list[Replica]) -> Replica | None:
        """Free `rep`'s slot and take one on the first of `ranked` with room (a retry)."""
        self.release(rep)
        return self._take(ranked)

    def transfer(self, rep: Replica, to: Replica) -> None:
        """Move a slot from `rep` to `to` whatever its cap: the request already runs there
        (EPP mode: the proxy sent it elsewhere than the pick)."""
        to.in_flight += 1
        self.held += 1
        self.release(rep)

    def release(self, rep: Replica) -> None:
        rep.in_flight -= 1
        self.held -= 1
        self._wake()

    def wake(self) -> None:
        """Slots freed elsewhere (a peer gateway's load went down): waiters look again."""
        self._wake()

    def _wake(self) -> None:
        if self.waiting:
            # Every waiter re-checks its own condition; later ones wait on a fresh event.
            freed, self._freed = self._freed, asyncio.Event()
            freed.set()

    async def _wait_for(self, take: Callable[[], T]) -> T:
        c = self.config
        retry = max(1, math.ceil(min(c.queue_timeout, 5.0)))
        if self.waiting >= c.max_queue:
            raise Overloaded(
                f"gateway overloaded: all replicas at --max-inflight-per-replica "
                f"{self.cap} and the queue is full (--max-queue {c.max_queue})",
                retry,
            )
        deadline = time.monotonic() + c.queue_timeout
        self.waiting += 1
        if self.shares is not None:
            self.shares.nudge()  # its demand grew: tell the peers now, the share follows
        try:
            while (left := deadline - time.monotonic()) > 0:
                freed = self._freed
                try:
                    async with asyncio.timeout(left):  # never wait_for: see gateway/tasks.py
                        await freed.wait()
                except TimeoutError:
                    break
                got = take()
                if got:
                    return got
        finally:
            self.waiting -= 1
        raise Overloaded(
            f"gateway overloaded: no replica slot freed within --queue-timeout "
            f"{c.queue_timeout:g}s (--max-inflight-per-replica {self.cap})",
            retry,
        )


def _room(split: Shares | None, cap: int, rep: Replica) -> int:
    return room(split, cap, rep.in_flight, rep.in_flight - rep.peer_in_flight, rep.id)


class RenderQueue:
    """The render threads and a bounded queue in front of them: when full, 429 at once.

    Rendering (tokenization, image decode, remote fetches) runs here, never on the event loop;
    a few threads so one slow image fetch does not hold up every other request, and a bound so
    a burst of slow requests cannot queue everyone else behind it for long.
    """

    def __init__(self, threads: int, max_queue: int) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="kvgate-render")
        self.max_queue = max_queue
        self.queued = 0  # submitted and not finished (running ones included)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        if self.queued >= self.max_queue:
            raise Overloaded(
                f"gateway overloaded: the render queue is full ({self.max_queue} requests "
                f"rendering or waiting to; --max-render-queue)",
                1,
            )
        self.queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.queued -= 1

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
