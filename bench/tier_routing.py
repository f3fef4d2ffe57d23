r"""Tier-aware routing against a fleet without a host tier, and against a gateway blind to it.

Three fleets of `--workers` sim workers (h200-llama-1b preset: a host-tier hit is charged the
preset's measured host-to-device copy, worker/engine/sim_runner.py) serve the same chat trace,
whose working set is several times the fleet's GPU caches (printed first: the tokens a single
worker with an unbounded cache computes, over the fleet's GPU blocks):

  tier_aware   workers with a host tier (`--kv-offload-blocks`), the gateway as it is
  tier_off     the same workers without one, the same gateway
  ignore_tier  workers with a host tier, the gateway with `--ignore-host-tier` (cache_aware
               that routes by the GPU's blocks alone, the behaviour before the tier)

All three run side by side; each is warmed once (bench/lib/rounds.py: the workload's first
turns on every worker and through its gateway), then `--rounds` rounds, each side on cold
caches (both tiers reset) in an order turned by one place every round, every round printed.
Per side: the hit rate per tier (the workers' own counters: `vllm:prefix_cache_hits` for the
GPU, `vllm:external_prefix_cache_hits` for the host tier, over the tokens looked up), TTFT p50 /
p90 as the client sees it (streams), and how many predictions were exact: in all
(`x-kvgate-predicted-cached-tokens` == the usage's cached tokens) and per request per tier
("tier exact": `x-kvgate-predicted-gpu-cached-tokens` and `-cpu-` == the GPU's part and the
worker's `usage.prompt_tokens_details.cpu_cached_tokens`), with the host-tier tokens predicted,
served (the workers' counters) and answered (the responses' usage) summed.

    python -m bench.tier_routing        # 4 workers x 600 blocks, 35 tenants (3x), 3 rounds
    python -m bench.tier_routing --workers 2 --num-blocks 200 --tenants 6 --rounds 1  # quick

`--sim-time-scale` (5) stretches every simulated step: on this shared 2-core machine each
request's own CPU work (rendering, hashing, events, HTTP) took hundreds of milliseconds, as much
as the H200's modelled time, and swung with the load; stretched, the modelled device dominates.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.lib.report import args_dict, col, columns, percentile, print_table, write_json
from bench.lib.rounds import medians, rotated, warm_up
from bench.lib.runs import Measured, add_workload_args, drive_policy, upper_bound, workload_spec
from harness import worker_metrics as wm
from harness.cluster import Cluster, ClusterSpec
from harness.driver import Result
from harness.workload import Workload

SIDES = ("tier_aware", "tier_off", "ignore_tier")
BLOCK = 16  # the sim workers' block size (tokens)


@dataclass(slots=True)
class Row:
    side: str = col("side", 13, left=True)
    round: int = col("run", 4)
    requests: int = col("reqs", 5)
    failed: int = col("fail", 5)
    gpu_hit: float = col("GPU hit", 9, ".1%")
    host_hit: float = col("host hit", 9, ".1%")
    ttft_p50_ms: float = col("TTFT p50", 10, ".0f", "ms")
    ttft_p90_ms: float = col("TTFT p90", 10, ".0f", "ms")
    exact: str = col("exact", 10)  # predicted == reported cached tokens, of the answered
    tier_exact: str = col("tier exact", 11)  # ... for the GPU's part and the host tier's both
    host_predicted: int = col("host pred", 11)  # host-tier tokens the gateway predicted
    host_reported: int = col("host hits", 11)  # host-tier tokens the workers served
    host_answered: int = col("host usage", 11)  # the same, summed from the responses' usage
    max_over_mean: float = col("max/mean", 9, ".2f")  # requests per worker
    seconds: float = col("s", 7, ".1f")


COLUMNS = columns(Row)


def make_row(side: str, m: Measured, round_: int) -> Row:
    ok = [r for r in m.results if r.ok]
    ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    workers = m.per_worker.values()
    queried = sum(c.queried_tokens for c in workers) or 1.0
    return Row(
        side=side,
        round=round_,
        requests=len(m.results),
        failed=len(m.results) - len(ok),
        gpu_hit=round(sum(c.hit_tokens for c in workers) / queried, 4),
        host_hit=round(sum(c.host_hit_tokens for c in workers) / queried, 4),
        ttft_p50_ms=round(percentile(ttfts, 0.5), 1),
        ttft_p90_ms=round(percentile(ttfts, 0.9), 1),
        exact=f"{sum(r.predicted_cached_tokens == r.cached_tokens for r in ok)}/{len(ok)}",
        tier_exact=f"{sum(tier_exact(r) for r in ok)}/{len(ok)}",
        host_predicted=sum(r.predicted_cpu_tokens or 0 for r in ok),
        host_answered=sum(r.cpu_cached_tokens or 0 for r in ok),
        host_reported=int(sum(c.host_hit_tokens for c in workers)),
        max_over_mean=round(wm.max_over_mean([c.requests for c in workers]), 2),
        seconds=round(m.seconds, 2),
    )


def tier_exact(r: Result) -> bool:
    """The gateway predicted this request's GPU part and host-tier part exactly. A worker
    without a host tier reports no host part: none of its cached tokens came from one."""
    predicted_cpu = r.predicted_cpu_tokens or 0
    reported_cpu = r.cpu_cached_tokens or 0
    predicted_gpu = (r.predicted_cached_tokens or 0) - predicted_cpu
    return (predicted_gpu, predicted_cpu) == (r.cached_tokens - reported_cpu, reported_cpu)


def side_spec(args: argparse.Namespace, side: str) -> ClusterSpec:
    host = () if side == "tier_off" else ("--kv-offload-blocks", str(args.host_blocks))
    blind = ("--ignore-host-tier",) if side == "ignore_tier" else ()
    return ClusterSpec(
        workers=args.workers,
        engine="sim",
        num_blocks=args.num_blocks,
        worker_args=(
            *("--sim-preset", args.sim_preset, "--sim-server-scale", str(args.sim_server_scale)),
            *("--sim-time-scale", str(args.sim_time_scale)),
            *host,
        ),
        gateway_args=("--poll-interval", "0.2", *blind, *args.gateway_arg),
        log_dir=args.log_dir / side,
        startup_timeout=120.0,
    )


def working_set(args: argparse.Namespace, workload: Workload) -> float:
    """The trace's working set over the fleet's GPU caches: the prompt tokens one worker with an
    unbounded cache computes (every token once), over `workers x num_blocks` blocks."""
    m = upper_bound(
        workload,
        replicas=1,
        num_blocks=1_000_000,
        concurrency=args.concurrency,
        log_dir=args.log_dir / "working_set",
    )
    ok = [r for r in m.results if r.ok]
    unique = sum(r.prompt_tokens - r.cached_tokens for r in ok)
    fleet = args.workers * args.num_blocks * BLOCK
    print(f"working set: {unique} tokens = {unique / fleet:.2f}x the fleet's GPU ({fleet} tokens)")
    return unique / fleet


def run(args: argparse.Namespace) -> tuple[list[Row], float]:
    workload = Workload(
        workload_spec(args, args.tenants, max_tokens=args.max_tokens, image_prob=0.0)
    )
    ratio = working_set(args, workload)
    sides = args.sides.split(",")
    clusters = {s: Cluster(side_spec(args, s)) for s in sides}
    rows: list[Row] = []
    try:
        for c in clusters.values():
            c.start()
        for s, c in clusters.items():
            failed = warm_up(c.gateway_url, c.worker_urls, workload, args.concurrency)
            print(f"warm-up {s}: {failed} failed")
        for round_ in range(args.rounds):
            for s in rotated(sides, round_):
                m = drive_policy(
                    clusters[s],
                    workload,
                    "cache_aware",
                    concurrency=args.concurrency,
                    stream=True,
                    timeout=600.0,
                )
                rows.append(make_row(s, m, round_))
                print_table(rows[-1:], COLUMNS, header=len(rows) == 1)
    finally:
        for c in clusters.values():
            c.stop()
    return rows, ratio


def ratios(rows: list[Row]) -> dict[str, float]:
    """tier_aware's TTFT p50 over each other side's, per round, then their median."""
    out: dict[str, float] = {}
    for other in ("tier_off", "ignore_tier"):
        per_round = []
        for k in sorted({r.round for r in rows}):
            mine = {r.side: r for r in rows if r.round == k}
            if "tier_aware" in mine and other in mine and mine[other].ttft_p50_ms:
                per_round.append(mine["tier_aware"].ttft_p50_ms / mine[other].ttft_p50_ms)
                print(f"run {k}: tier_aware TTFT p50 / {other}'s = {per_round[-1]:.2f}")
        if per_round:
            out[other] = round(statistics.median(per_round), 3)
    return out


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=600, help="GPU KV blocks per worker")
    ap.add_argument(
        "--host-blocks", type=int, default=3000, help="host-tier blocks per worker (its sides)"
    )
    ap.add_argument("--sim-preset", default="h200-llama-1b")
    ap.add_argument("--sim-server-scale", type=float, default=1.0)
    ap.add_argument("--sim-time-scale", type=float, default=5.0)
    ap.add_argument("--tenants", type=int, default=35)
    add_workload_args(ap)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gateway-arg", action="append", default=[])
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/tier_routing"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/tier_routing.json"))
    return ap.parse_args()


def main() -> None:
    args = _arguments()
    rows, ratio = run(args)
    middle = medians(rows, key="side")
    print(f"medians over {args.rounds} rounds (run -1):")
    print_table(middle, COLUMNS)
    rel = ratios(rows)
    for other, r in rel.items():
        print(f"tier_aware TTFT p50 / {other}'s, median of the rounds: {r:.2f}")
    write_json(
        args.out,
        {
            "args": args_dict(args),
            "working_set_over_fleet_gpu": round(ratio, 2),
            "results": [asdict(r) for r in rows],
            "medians": [asdict(r) for r in middle],
            "ttft_p50_ratios": rel,
        },
    )


if __name__ == "__main__":
    main()
