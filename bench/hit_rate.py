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
from the workers' request counters (an idle replica counts).

    python -m bench.hit_rate                         # table + bench/results/hit_rate.json
    python -m bench.hit_rate --replicas 4 --policies cache_aware,round_robin
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import worker_metrics as wm
from bench.cluster import Cluster, ClusterSpec
from bench.driver import Result, hit_rate, run_workload
from bench.workload import Turn, Workload, WorkloadSpec

POLICY_HEADER = "x-kvgate-routing-policy"
SESSION_HEADER = "x-session-id"
ALL_POLICIES = ("cache_aware", "round_robin", "least_loaded", "session", "random")
# Long enough for AllBlocksCleared to reach the gateway and its speculative entries (2 s) to expire.
SETTLE_S = 2.5


@dataclass(slots=True)
class Row:
    replicas: int
    policy: str
    blocks_per_replica: int
    requests: int
    failed: int
    hit_rate: float  # from the responses' cached_tokens
    worker_hit_rate: float  # from the workers' prefix-cache counters
    max_over_mean: float | None
    requests_per_replica: list[int]
    seconds: float


def scaled_spec(replicas: int, args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        tenants=args.tenants_per_replica * replicas,
        users_per_tenant=args.users_per_tenant,
        turns=args.turns,
        system_words=args.system_words,
        seed=args.seed,
    )


def session_header(turn: Turn) -> dict[str, str]:
    return {SESSION_HEADER: turn.conversation}


def drive(
    url: str, workers: list[str], workload: Workload, headers: dict[str, str], concurrency: int
) -> tuple[list[Result], dict[str, wm.WorkerCounters], float]:
    before = wm.scrape_all(workers)
    t0 = time.perf_counter()
    results = asyncio.run(
        run_workload(
            url,
            workload,
            concurrency=concurrency,
            headers=headers,
            headers_for=session_header,
        )
    )
    seconds = time.perf_counter() - t0
    return results, wm.deltas(before, wm.scrape_all(workers)), seconds


def make_row(
    replicas: int,
    policy: str,
    blocks: int,
    results: list[Result],
    per_worker: dict[str, wm.WorkerCounters],
    seconds: float,
) -> Row:
    counts = [round(c.requests) for c in per_worker.values()]
    return Row(
        replicas=replicas,
        policy=policy,
        blocks_per_replica=blocks,
        requests=len(results),
        failed=sum(not r.ok for r in results),
        hit_rate=hit_rate(results),
        worker_hit_rate=wm.hit_rate(per_worker),
        max_over_mean=wm.max_over_mean(counts) if len(counts) > 1 else None,
        requests_per_replica=counts,
        seconds=round(seconds, 2),
    )


def run_replicas(replicas: int, policies: list[str], args: argparse.Namespace) -> list[Row]:
    workload = Workload(scaled_spec(replicas, args))
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
            wm.reset_prefix_caches(c.worker_urls)
            time.sleep(SETTLE_S)
            res, per_worker, secs = drive(
                c.gateway_url, c.worker_urls, workload, {POLICY_HEADER: policy}, args.concurrency
            )
            rows.append(make_row(replicas, policy, args.num_blocks, res, per_worker, secs))
            print_rows(rows[-1:], header=len(rows) == 1)
    # The upper bound: one worker holding all N caches, no gateway in the way.
    big = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=args.num_blocks * replicas,
        gateways=0,
        log_dir=log_dir / "upper",
    )
    with Cluster(big) as c:
        res, per_worker, secs = drive(
            c.worker_urls[0], c.worker_urls, workload, {}, args.concurrency
        )
        rows.append(make_row(replicas, "upper_bound", big.num_blocks or 0, res, per_worker, secs))
        print_rows(rows[-1:], header=False)
    return rows


def print_rows(rows: list[Row], header: bool = True) -> None:
    if header:
        print(
            f"{'N':>3} {'policy':<13}{'blocks':>7}{'reqs':>6}{'fail':>5}{'hit':>8}"
            f"{'worker hit':>11}{'max/mean':>9}{'s':>7}"
        )
    for r in rows:
        bal = f"{r.max_over_mean:.2f}" if r.max_over_mean is not None else "-"
        print(
            f"{r.replicas:>3} {r.policy:<13}{r.blocks_per_replica:>7}{r.requests:>6}{r.failed:>5}"
            f"{r.hit_rate:>8.1%}{r.worker_hit_rate:>11.1%}{bal:>9}{r.seconds:>7.1f}",
            flush=True,
        )


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicas", default="4,8,16", help="comma-separated replica counts")
    ap.add_argument("--policies", default=",".join(ALL_POLICIES))
    ap.add_argument("--num-blocks", type=int, default=860, help="KV blocks per replica")
    ap.add_argument("--tenants-per-replica", type=int, default=3)
    ap.add_argument("--users-per-tenant", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-words", type=int, default=1200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/hit_rate"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/hit_rate.json"))
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(ALL_POLICIES)
    if unknown:
        ap.error(f"unknown policies: {sorted(unknown)}")
    rows: list[Row] = []
    for n in (int(x) for x in args.replicas.split(",")):
        rows += run_replicas(n, policies, args)
    summary = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": [asdict(r) for r in rows],
        "ratios": ratios(rows),
    }
    for n, entry in summary["ratios"].items():
        print(f"N={n}: " + ", ".join(f"{k} {v:.2f}" for k, v in entry.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
