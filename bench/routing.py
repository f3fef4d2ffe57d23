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
import json
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.cluster import Cluster, ClusterSpec
from bench.driver import hit_rate, run_workload
from bench.workload import Workload, WorkloadSpec

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


def _summarize(policy: str, workers: int, num_blocks: int, results) -> PolicyResult:
    ok = [r for r in results if r.ok]
    counts = Counter(r.replica for r in ok)
    mean = len(ok) / max(len(counts), 1)
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
        max_over_mean=max(counts.values()) / mean if counts else 0.0,
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
    direct = policy == "single_worker"
    spec = ClusterSpec(
        workers=1 if direct else workers,
        engine="sim",
        num_blocks=num_blocks * workers if direct else num_blocks,
        policy="cache_aware" if direct else policy,
        gateways=0 if direct else 1,
        gateway_args=GATEWAY_ARGS,
        log_dir=log_dir / policy,
    )
    with Cluster(spec) as c:
        url = c.worker_urls[0] if direct else c.gateway_url
        results = asyncio.run(run_workload(url, workload, concurrency=concurrency))
    return _summarize(policy, spec.workers, spec.num_blocks or 0, results)


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


def print_table(rows: list[PolicyResult]) -> None:
    print(
        f"{'policy':<14}{'workers':>8}{'blocks':>8}{'reqs':>6}{'fail':>6}{'hit rate':>10}"
        f"{'exact pred':>12}{'max/mean':>10}"
    )
    for r in rows:
        exact = f"{r.exact_predictions:.1%}" if r.exact_predictions is not None else "-"
        print(
            f"{r.policy:<14}{r.workers:>8}{r.num_blocks:>8}{r.requests:>6}{r.failed:>6}"
            f"{r.hit_rate:>10.1%}{exact:>12}{r.max_over_mean:>10.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policies", default="cache_aware,round_robin,single_worker")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=860, help="KV blocks per worker")
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--users-per-tenant", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-words", type=int, default=1200)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/routing.json"))
    args = ap.parse_args()
    spec = WorkloadSpec(
        tenants=args.tenants,
        users_per_tenant=args.users_per_tenant,
        turns=args.turns,
        system_words=args.system_words,
        seed=args.seed,
    )
    rows = compare(
        spec,
        args.policies.split(","),
        workers=args.workers,
        num_blocks=args.num_blocks,
        concurrency=args.concurrency,
    )
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
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
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
