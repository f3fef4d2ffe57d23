"""Token hit rate of every routing policy at 4, 8 and 16 replicas, against an upper bound.

For each replica count N, one cluster of N `sim` workers (zero compute time, `--num-blocks` each)
and one gateway serves the same deterministic trace once per policy; the policy is chosen per
request with the `x-kvgate-routing-policy` header and every worker's prefix cache is reset
between policies, so all policies see identical, cold clusters. The workload grows with N
(`--tenants-per-replica` tenants per replica) so each replica's cache holds about a third of its
share of distinct blocks. The upper bound is one worker with N x the blocks serving the trace
directly: a perfect router over N caches can approach it, never beat it.

Hit rate is reported twice: from the responses (`usage.prompt_tokens_details.cached_tokens`)
and from the workers' own prefix-cache counters; load balance is max/mean requests per replica
from the workers' request counters (an idle replica counts). "exact pred" is the share of
requests whose cached tokens the gateway predicted exactly (`x-kvgate-predicted-cached-tokens`).

    python -m bench.hit_rate                         # table + bench/results/hit_rate.json
    python -m bench.hit_rate --replicas 4 --policies cache_aware,round_robin
    python -m bench.hit_rate --replicas 4 --tenants 12 --concurrency 1   # a fixed workload
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.lib.report import args_dict, col, columns, print_table, write_json
from bench.lib.runs import (
    Measured,
    add_workload_args,
    drive_policy,
    session_header,
    upper_bound,
    workload_spec,
)
from harness import worker_metrics as wm
from harness.cluster import Cluster, ClusterSpec
from harness.driver import Result, hit_rate
from harness.workload import Workload

ALL_POLICIES = ("cache_aware", "round_robin", "least_loaded", "session", "random")


@dataclass(slots=True)
class Row:
    replicas: int = col("N", 3)
    policy: str = col("policy", 13, left=True, sep=" ")
    blocks_per_replica: int = col("blocks", 7)
    requests: int = col("reqs", 6)
    failed: int = col("fail", 5)
    hit_rate: float = col("hit", 8, ".1%")  # from the responses' cached_tokens
    worker_hit_rate: float = col("worker hit", 11, ".1%")  # from the workers' prefix-cache counters
    # share of requests whose predicted cached tokens equal the reported ones
    exact_predictions: float | None = col("exact pred", 11, ".1%")
    max_over_mean: float | None = col("max/mean", 9, ".2f")
    requests_per_replica: list[int]
    seconds: float = col("s", 7, ".1f")


COLUMNS = columns(Row)


def exact_share(results: list[Result]) -> float | None:
    """Share of the answered requests whose predicted cached tokens equal the reported ones
    (None when nothing predicted: the upper bound has no gateway)."""
    predicted = [r for r in results if r.ok and r.predicted_cached_tokens is not None]
    if not predicted:
        return None
    return sum(r.predicted_cached_tokens == r.cached_tokens for r in predicted) / len(predicted)


def make_row(replicas: int, policy: str, blocks: int, m: Measured) -> Row:
    counts = [round(c.requests) for c in m.per_worker.values()]
    return Row(
        replicas=replicas,
        policy=policy,
        blocks_per_replica=blocks,
        requests=len(m.results),
        failed=sum(not r.ok for r in m.results),
        hit_rate=hit_rate(m.results),
        worker_hit_rate=wm.hit_rate(m.per_worker),
        exact_predictions=exact_share(m.results),
        max_over_mean=wm.max_over_mean(counts) if len(counts) > 1 else None,
        requests_per_replica=counts,
        seconds=round(m.seconds, 2),
    )


def run_replicas(replicas: int, policies: list[str], args: argparse.Namespace) -> list[Row]:
    workload = Workload(workload_spec(args, args.tenants or args.tenants_per_replica * replicas))
    log_dir = args.log_dir / f"n{replicas}"
    rows: list[Row] = []
    spec = ClusterSpec(
        workers=replicas,
        engine="sim",
        num_blocks=args.num_blocks,
        gateway_args=("--poll-interval", "0.2"),
        log_dir=log_dir,
    )
    with Cluster(spec) as c:
        for policy in policies:
            m = drive_policy(c, workload, policy, concurrency=args.concurrency)
            rows.append(make_row(replicas, policy, args.num_blocks, m))
            print_table(rows[-1:], COLUMNS, header=len(rows) == 1)
    m = upper_bound(
        workload,
        replicas=replicas,
        num_blocks=args.num_blocks,
        concurrency=args.concurrency,
        log_dir=log_dir / "upper",
        headers_for=session_header,
    )
    rows.append(make_row(replicas, "upper_bound", args.num_blocks * replicas, m))
    print_table(rows[-1:], COLUMNS, header=False)
    return rows


def ratios(rows: list[Row]) -> dict[str, dict[str, float]]:
    """Per replica count: cache_aware over round_robin, and cache_aware as a share of the bound."""
    out: dict[str, dict[str, float]] = {}
    for n in sorted({r.replicas for r in rows}):
        hit = {r.policy: r.hit_rate for r in rows if r.replicas == n}
        ca = hit.get("cache_aware")
        entry = {}
        if ca is not None and hit.get("round_robin"):
            entry["cache_aware_over_round_robin"] = round(ca / hit["round_robin"], 3)
        if ca is not None and hit.get("upper_bound"):
            entry["cache_aware_share_of_upper_bound"] = round(ca / hit["upper_bound"], 3)
        out[str(n)] = entry
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicas", default="4,8,16", help="comma-separated replica counts")
    ap.add_argument("--policies", default=",".join(ALL_POLICIES))
    ap.add_argument("--num-blocks", type=int, default=860, help="KV blocks per replica")
    ap.add_argument("--tenants-per-replica", type=int, default=3)
    ap.add_argument("--tenants", type=int, help="a fixed tenant count (not per replica)")
    add_workload_args(ap)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/hit_rate"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/hit_rate.json"))
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(ALL_POLICIES)
    if unknown:
        ap.error(f"unknown policies: {sorted(unknown)}")
    rows: list[Row] = []
    for n in (int(x) for x in args.replicas.split(",")):
        rows += run_replicas(n, policies, args)
    summary = {
        "args": args_dict(args),
        "results": [asdict(r) for r in rows],
        "ratios": ratios(rows),
    }
    for n, entry in summary["ratios"].items():
        print(f"N={n}: " + ", ".join(f"{k} {v:.2f}" for k, v in entry.items()))
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
