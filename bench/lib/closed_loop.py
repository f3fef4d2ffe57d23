"""Closed-loop load of short chats (`max_tokens` 1): many clients against a router or straight
against the workers, as requests/s and latency percentiles. With `ZERO_COMPUTE` sim workers answer
as fast as HTTP allows, so what sits in between is what limits."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from bench.lib.report import col, columns, percentile, print_table

ZERO_COMPUTE = ("--sim-prefill-s-per-token", "0", "--sim-decode-s-per-step", "0")
BODY = {
    "model": "demo",
    "messages": [{"role": "user", "content": "a short question about caches " * 8}],
    "max_tokens": 1,
}


@dataclass(slots=True)
class Load:
    target: str = col("target", 24, left=True)
    concurrency: int = col("clients", 8)
    requests: int = col("reqs", 6)
    failed: int = col("fail", 5)
    requests_per_s: float = col("req/s", 9, ".1f")
    p50_ms: float = col("p50 ms", 9, ".2f")
    p99_ms: float = col("p99 ms", 9, ".2f")


COLUMNS = columns(Load)


async def _fire(urls: list[str], n: int, concurrency: int) -> tuple[list[float], int, float]:
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    failed = 0
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def one(i: int) -> None:
            nonlocal failed
            async with sem:
                t0 = time.perf_counter()
                try:
                    r = await client.post(f"{urls[i % len(urls)]}/v1/chat/completions", json=BODY)
                    r.raise_for_status()
                    lat.append(time.perf_counter() - t0)
                except httpx.HTTPError:
                    failed += 1

        await asyncio.gather(*(one(i) for i in range(min(n, 2 * concurrency))))  # warm-up
        lat.clear()
        failed = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return lat, failed, wall


def measure(target: str, urls: list[str], n: int, concurrency: int) -> Load:
    """`n` requests at `concurrency` against `urls` (one router, or the workers themselves)."""
    lat, failed, wall = asyncio.run(_fire(urls, n, concurrency))
    return Load(
        target=target,
        concurrency=concurrency,
        requests=n,
        failed=failed,
        requests_per_s=round(len(lat) / wall, 1),
        p50_ms=round(percentile(lat, 0.5) * 1000, 2),
        p99_ms=round(percentile(lat, 0.99) * 1000, 2),
    )


def print_loads(rows: list[Load], header: bool = True) -> None:
    print_table(rows, COLUMNS, header)
