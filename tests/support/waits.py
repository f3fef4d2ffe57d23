"""Waiting for a condition inside a test. Blocking waits use `harness.cluster.wait_until`
(shared with the benchmarks); these are the ones a test on an event loop needs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(cond: Callable[[], object], what: str = "condition", timeout: float = 5.0) -> None:
    """Poll `cond` every 10 ms without blocking the loop; AssertionError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.01)
