"""Waiting for a condition inside a test. Blocking waits on a condition use
`harness.cluster.wait_until` (shared with the benchmarks); here: the wait a test on an event loop
needs, and the wait for a gateway's index to hold every replica."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx


async def until(cond: Callable[[], object], what: str = "condition", timeout: float = 5.0) -> None:
    """Poll `cond` every 10 ms without blocking the loop; AssertionError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.01)


def wait_synced(gateway_url: str, replicas: int, timeout: float = 20.0) -> dict:
    """Poll a gateway's (or an EPP's) `/kvgate/index` until it lists `replicas` replicas, each
    polled healthy and its events subscribed; returns that index."""
    deadline = time.monotonic() + timeout
    while True:
        index = httpx.get(f"{gateway_url}/kvgate/index", timeout=5).json()
        reps = index["replicas"].values()
        if len(reps) == replicas and all(r["synced"] and r["healthy"] for r in reps):
            return index
        if time.monotonic() > deadline:
            raise AssertionError(f"{gateway_url} did not sync {replicas} replicas: {index}")
        time.sleep(0.1)


def try_get(url: str, timeout: float = 2.0) -> httpx.Response | None:
    """GET `url`; None while nothing answers there (a server still starting, or gone)."""
    try:
        return httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None
