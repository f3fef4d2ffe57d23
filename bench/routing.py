"""Token hit rate of routing policies on the shared-prefix workload, with real sim workers.

For each policy a fresh cluster (N sim workers, each with `--num-blocks`) serves the same
deterministic trace through one gateway; a single worker with N x the blocks serving the trace
directly is the reference ("ideal" cache-aware routing can approach it, never beat it).

    python -m bench.routing                       # table + bench/results/routing.json
    python -m bench.routing --tenants 8 --num-blocks 600 --policies cache_aware,round_robin,random
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.lib.report import Col, print_table, write_json
from bench.lib.runs import add_workload_args, upper_bound, workload_spec
from harness import worker_metrics as wm
from harness.cluster import Cluster, ClusterSpec
from harness.driver import Result, hit_rate, run_workload
from harness.workload import Workload, WorkloadSpec

GATEWAY_ARGS = ("--poll-interval", "0.2")


@dataclass(slots=True)
class PolicyResult:
    policy: str
    workers: int
    num_blocks: int
    requests: int
    failed: int
    hit_rate: float
    exact_predictions: float | None  # share of requests whose predicted == reported cached
    requests_per_replica: dict[str, int]
    max_over_mean: float


COLUMNS = (
    Col("policy", "policy", 14, left=True),
    Col("workers", "workers", 8),
    Col("num_blocks", "blocks", 8),
    Col("requests", "reqs", 6),
    Col("failed", "fail", 6),
    Col("hit_rate", "hit rate", 10, ".1%"),
    Col("exact_predictions", "exact pred", 12, ".1%"),
    Col("max_over_mean", "max/mean", 10, ".2f"),
)


def _summarize(policy: str, workers: int, num_blocks: int, results: list[Result]) -> PolicyResult:
    ok = [r for r in results if r.ok]
    # Requests per replica as the gateway named them (replicas that served nothing are absent).
    counts = Counter(r.replica for r in ok)
    predicted = [r for r in ok if r.predicted_cached_tokens is not None]
    exact = (
        sum(r.predicted_cached_tokens == r.cached_tokens for r in predicted) / len(predicted)
        if predicted
        else None
    )
    return PolicyResult(
        policy=policy,
        workers=workers,
        num_blocks=num_blocks,
        requests=len(results),
        failed=len(results) - len(ok),
        hit_rate=hit_rate(results),
        exact_predictions=exact,
        requests_per_replica=dict(sorted(counts.items())),
        max_over_mean=wm.max_over_mean(list(counts.values())),
    )


def run_policy(
    workload: Workload,
    policy: str,
    *,
    workers: int,
    num_blocks: int,
    concurrency: int,
    log_dir: Path,
) -> PolicyResult:
    """`single_worker` is the upper bound: one worker with `workers` x the blocks, no gateway."""
    if policy == "single_worker":
        m = upper_bound(
            workload,
            replicas=workers,
            num_blocks=num_blocks,
            concurrency=concurrency,
            log_dir=log_dir / policy,
        )
        return _summarize(policy, 1, num_blocks * workers, m.results)
    spec = ClusterSpec(
        workers=workers,
        engine="sim",
        num_blocks=num_blocks,
        policy=policy,
        gateway_args=GATEWAY_ARGS,
        log_dir=log_dir / policy,
    )
    with Cluster(spec) as c:
        results = asyncio.run(run_workload(c.gateway_url, workload, concurrency=concurrency))
    return _summarize(policy, workers, num_blocks, results)


def compare(
    spec: WorkloadSpec,
    policies: list[str],
    *,
    workers: int = 4,
    num_blocks: int = 860,
    concurrency: int = 1,
    log_dir: Path | None = None,
) -> list[PolicyResult]:
    workload = Workload(spec)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvgate-routing-"))
    return [
        run_policy(
            workload,
            p,
            workers=workers,
            num_blocks=num_blocks,
            concurrency=concurrency,
            log_dir=log_dir,
        )
        for p in policies
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policies", default="cache_aware,round_robin,single_worker")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=860, help="KV blocks per worker")
    ap.add_argument("--tenants", type=int, default=12)
    add_workload_args(ap)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("bench/results/routing.json"))
    args = ap.parse_args()
    spec = workload_spec(args, args.tenants)
    rows = compare(
        spec,
        args.policies.split(","),
        workers=args.workers,
        num_blocks=args.num_blocks,
        concurrency=args.concurrency,
    )
    print_table(rows, COLUMNS)
    hit = {r.policy: r.hit_rate for r in rows}
    summary = {"workload": asdict(spec), "results": [asdict(r) for r in rows]}
    if "round_robin" in hit and "cache_aware" in hit and hit["round_robin"] > 0:
        summary["cache_aware_over_round_robin"] = hit["cache_aware"] / hit["round_robin"]
        print(f"cache_aware / round_robin hit rate: {summary['cache_aware_over_round_robin']:.2f}x")
    if "single_worker" in hit and "cache_aware" in hit and hit["single_worker"] > 0:
        summary["cache_aware_over_single_worker"] = hit["cache_aware"] / hit["single_worker"]
        print(
            f"cache_aware / single worker (4x blocks): "
            f"{summary['cache_aware_over_single_worker']:.1%}"
        )
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
