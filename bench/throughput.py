"""Throughput ceiling: the most requests/s through a router vs straight to the workers.

Many concurrent clients send a short chat (`max_tokens` 1) to `sim` workers with zero compute
time, so the workers answer as fast as HTTP allows and the router in the middle is what limits.
"direct" spreads the requests over the workers itself. The same client drives every target in
one run, so the ratio (via router / direct) is the figure to read on a shared CPU.

    python -m bench.throughput                       # table + bench/results/throughput.json
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from bench.lib.closed_loop import ZERO_COMPUTE, Load, measure, print_loads
from bench.lib.report import write_json
from harness.cluster import Cluster, ClusterSpec


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
