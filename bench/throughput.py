"""Throughput ceiling: the most requests/s through a router vs straight to the workers.

Many concurrent clients send a short chat (`max_tokens` 1) to `sim` workers with zero compute
time, so the workers answer as fast as HTTP allows and the router in the middle is what limits.
"direct" spreads the requests over the workers itself. The same client drives every target in
one run, so the ratio (via router / direct) is the figure to read on a shared CPU.

    python -m bench.throughput                       # table + bench/results/throughput.json
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.lib.report import Col, percentile, print_table, write_json
from harness.cluster import Cluster, ClusterSpec

ZERO_COMPUTE = ("--sim-prefill-s-per-token", "0", "--sim-decode-s-per-step", "0")
BODY = {
    "model": "demo",
    "messages": [{"role": "user", "content": "a short question about caches " * 8}],
    "max_tokens": 1,
}


@dataclass(slots=True)
class Load:
    target: str
    concurrency: int
    requests: int
    failed: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float


COLUMNS = (
    Col("target", "target", 24, left=True),
    Col("concurrency", "clients", 8),
    Col("requests", "reqs", 6),
    Col("failed", "fail", 5),
    Col("requests_per_s", "req/s", 9, ".1f"),
    Col("p50_ms", "p50 ms", 9, ".2f"),
    Col("p99_ms", "p99 ms", 9, ".2f"),
)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", default="1,64", help="comma-separated client counts")
    ap.add_argument("--out", type=Path, default=Path("bench/results/throughput.json"))
    args = ap.parse_args()
    spec = ClusterSpec(
        workers=args.workers,
        engine="sim",
        worker_args=ZERO_COMPUTE,
        gateway_args=("--poll-interval", "0.5"),
        log_dir=Path("bench/results/logs/throughput"),
    )
    rows: list[Load] = []
    with Cluster(spec) as c:
        for conc in (int(x) for x in args.concurrency.split(",")):
            n = args.requests if conc > 1 else args.requests // 4
            rows.append(measure("direct", c.worker_urls, n, conc))
            rows.append(measure("kvgate cache_aware", [c.gateway_url], n, conc))
            print_loads(rows[-2:], header=len(rows) == 2)
    ceiling = {
        str(r.concurrency): round(r.requests_per_s / d.requests_per_s, 3)
        for d, r in zip(rows[::2], rows[1::2], strict=True)
        if d.requests_per_s
    }
    print(
        "via gateway / direct req/s: "
        + ", ".join(f"{k} clients {v:.2f}" for k, v in ceiling.items())
    )
    summary = {"args": vars(args) | {"out": str(args.out)}, "results": [asdict(r) for r in rows]}
    summary["gateway_over_direct_req_s"] = ceiling
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
