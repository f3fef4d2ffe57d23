"""What the discovery tests share: a callback that records every set a discovery emits (worker
URLs, or peer addresses)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from gateway.discovery.endpoints import WorkerEndpoint

WAIT_S = 10.0


class Recorder:
    """Collects every set the discovery emits."""

    def __init__(self) -> None:
        self.sets: list[frozenset[str]] = []
        self.changed = asyncio.Event()

    async def __call__(self, found: frozenset[WorkerEndpoint] | frozenset[str]) -> None:
        self.sets.append(frozenset(w if isinstance(w, str) else w.url for w in found))
        self.changed.set()

    async def until(self, expected: set[str]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not (self.sets and self.sets[-1] == expected):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"wanted {sorted(expected)}, last sets {self.sets[-3:]}")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=left)
