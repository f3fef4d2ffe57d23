"""Routing under load: every policy at concurrency 1, 4, 16 and 64, uniform and hot-tenant traffic.

The held-out multi-tenant multimodal chat trace (`bench.lib.load_runs.trace`: 96 conversations of 3
turns in 24 tenants; in the hot variant one tenant holds half the conversations), each
conversation's turns in order, through one gateway to 4 sim workers that charge GPU-like time
(200 us per uncached prompt token, 2 ms per engine step), each caching about a third of the
trace's distinct blocks. Per (variant, concurrency) one fresh cluster serves the trace once per
policy, cache_aware first, every cache reset in between; requests stream, so TTFT is measured.

    python -m bench.under_load                    # table + bench/results/under_load.json
    python -m bench.under_load --variants uniform --concurrency 16 --seed 0
    python -m bench.under_load --variants hot --concurrency 4 --policies cache_aware --repeat 6
    python -m bench.under_load --variants uniform --concurrency 16 --tenants 12 --users-per-tenant 8

`--sim-preset h200-llama-1b` times the sim workers like the GPU they were calibrated on instead
(worker/engine/sim_presets.py; `--sim-server-scale 0`: without the worker server's own cost).
With `--repeat N` the policy order turns by one place each time (the first pays the host's noise
at that moment, each policy in its turn).

After each set of policies it prints the run's start-up floor (harness/floor.py): the p99
that no router sending each request on arrival can beat, and how many requests ended above it.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from bench.lib.load_runs import (
    COLUMNS,
    GATEWAY_ARGS,
    SEED,
    SIM_COST,
    LoadRow,
    blocks_per_worker,
    run_once,
    trace,
)
from bench.lib.report import args_dict, print_table, write_json
from bench.lib.rounds import medians
from harness.cluster import Cluster, ClusterSpec
from harness.floor import Floor, startup_floor
from harness.workload import WorkloadSpec
from worker.engine.config import SIM_SERVER_MODELS

POLICIES = ("cache_aware", "least_loaded", "round_robin")
WORKERS = 4
STEP_TOKENS = 2048  # the sim workers' --max-num-batched-tokens (the engine's default)


def run_variant(variant: str, args: argparse.Namespace) -> list[LoadRow]:
    workload = trace(variant == "hot", args.seed, args.tenants, args.users_per_tenant)
    blocks = blocks_per_worker(workload)
    print(f"{variant}: {len(workload)} requests, {blocks} blocks per worker", flush=True)
    rows: list[LoadRow] = []
    n = len(args.policies)
    for conc in args.concurrency:
        spec = ClusterSpec(
            workers=WORKERS,
            engine="sim",
            num_blocks=blocks,
            worker_args=sim_args(args),
            gateway_args=(*GATEWAY_ARGS, *args.gateway_arg),
            log_dir=args.log_dir / f"{variant}-c{conc}",
        )
        with Cluster(spec) as c:
            urls, workers = [g.url for g in c.gateways], c.worker_urls
            for i in range(args.repeat):
                label = variant if args.repeat == 1 else f"{variant}.{i}"
                block = []
                for policy in args.policies[i % n :] + args.policies[: i % n]:
                    row = run_once(c.gateway_url, urls, workers, workload, policy, conc, label)
                    block.append(row)
                    print_table([row], COLUMNS, header=len(rows) + len(block) == 1)
                rows += block
                if not args.sim_preset and (line := explain_floor(block)):
                    print(line, flush=True)
    return rows


def repeat_medians(rows: list[LoadRow]) -> list[LoadRow]:
    """Per (variant, concurrency), each policy's medians over the repeats (detail dropped)."""
    out = []
    for variant, conc in dict.fromkeys((r.label.split(".")[0], r.concurrency) for r in rows):
        group = [r for r in rows if (r.label.split(".")[0], r.concurrency) == (variant, conc)]
        for row in medians(group):
            row.label, row.detail = variant, []
            out.append(row)
    return out


def sim_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The sim workers' timing: the flat default (SIM_COST), or a device's preset."""
    if not args.sim_preset:
        return SIM_COST
    scales = ("--sim-server-scale", str(args.sim_server_scale))
    scales += ("--sim-server-model", args.sim_server_model)
    return ("--sim-preset", args.sim_preset, *scales, "--sim-time-scale", str(args.sim_time_scale))


def ratios(rows: list[LoadRow]) -> dict[str, dict[str, float]]:
    """cache_aware against the others, per (variant, concurrency): the issue's acceptance."""
    out: dict[str, dict[str, float]] = {}
    for key in sorted({(r.label, r.concurrency) for r in rows}):
        by = {r.policy: r for r in rows if (r.label, r.concurrency) == key}
        ca, rr, ll = by.get("cache_aware"), by.get("round_robin"), by.get("least_loaded")
        if ca is None or rr is None:
            continue
        entry = {
            "hit_over_round_robin": ca.hit_rate / rr.hit_rate if rr.hit_rate else 0.0,
            "p50_over_round_robin": ca.latency_p50_ms / rr.latency_p50_ms,
        }
        if ll is not None:
            best_p99 = min(rr.latency_p99_ms, ll.latency_p99_ms)
            entry["p99_over_best_of_rr_ll"] = ca.latency_p99_ms / best_p99
            entry["p99_target_ms"] = 0.8 * best_p99
            fl = floor_of(ca)
            if fl.per_replica > 1 and fl.binds_p99:
                entry["startup_floor_ms"] = fl.seconds * 1000
            best = min(rr.warm_p99_ms, ll.warm_p99_ms)
            entry["warm_p99_over_best"] = ca.warm_p99_ms / best if best else 0.0
        seq = next(
            (r for r in rows if (r.label, r.concurrency, r.policy) == (key[0], 1, ca.policy)),
            None,
        )
        if seq is not None and seq.hit_rate:
            entry["hit_over_own_sequential"] = ca.hit_rate / seq.hit_rate
        out[f"{key[0]} c{key[1]}"] = {k: round(v, 3) for k, v in entry.items()}
    return out


def floor_of(row: LoadRow) -> Floor:
    """The run's start-up floor (harness/floor.py), from the requests it opened with."""
    opening = sorted(row.detail, key=lambda d: d[8])[: row.concurrency]
    tenants = [(conv.split("-")[0], prompt) for conv, _, _, prompt, *_ in opening]
    s_per_token = float(SIM_COST[SIM_COST.index("--sim-prefill-s-per-token") + 1])
    max_tokens = WorkloadSpec().max_tokens  # what trace() asks of every request
    return startup_floor(tenants, row.requests, WORKERS, s_per_token, max_tokens, STEP_TOKENS)


def explain_floor(rows: list[LoadRow]) -> str | None:
    """One line: the floor of a (variant, concurrency) block, and who ended above it."""
    fl = floor_of(rows[0])
    if fl.per_replica < 2:
        return None
    late = ", ".join(f"{r.policy} {sum(d[6] >= fl.seconds for d in r.detail)}" for r in rows)
    binds = "so no policy's p99 can be below it" if fl.binds_p99 else "too few to bind the p99"
    return (
        f"{rows[0].label} c{rows[0].concurrency}: start-up floor {fl.seconds * 1000:,.0f} ms:"
        f" {fl.tenants} tenants in the opening {rows[0].concurrency} requests, so"
        f" {fl.busiest} replica(s) take {fl.per_replica} full prefills each and"
        f" {fl.requests} requests end after it, {binds}. Requests that ended after it: {late}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variants", default="uniform,hot")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--tenants", type=int, default=24, help="tenants in the trace (default 24)")
    ap.add_argument(
        "--users-per-tenant", type=int, default=None,
        help="conversations per tenant (default 4; hot: 2, with half of all in one tenant)",
    )  # fmt: skip
    ap.add_argument(
        "--repeat", type=int, default=1,
        help="serve the trace this many times per policy on the same cluster (rows labelled"
        " variant.i): the spread of single runs",
    )  # fmt: skip
    ap.add_argument("--sim-preset", default=None, help="time the sim workers by this preset")
    ap.add_argument(
        "--sim-server-scale", type=float, default=1.0,
        help="with --sim-preset: share of the worker server's own measured cost (0: none)",
    )  # fmt: skip
    ap.add_argument(
        "--sim-server-model", choices=SIM_SERVER_MODELS, default="step",
        help="with --sim-preset: where the worker server's cost goes (the worker's flag)",
    )  # fmt: skip
    ap.add_argument(
        "--sim-time-scale", type=float, default=1.0,
        help="with --sim-preset: every step's time times this (a busy host: 2 or more)",
    )  # fmt: skip
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/under_load"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/under_load.json"))
    ap.add_argument(
        "--gateway-arg", action="append", default=[],
        help="one more argument for the gateway (repeat it), e.g. --gateway-arg=--busy-weight=0.5",
    )  # fmt: skip
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.policies = [p for p in args.policies.split(",") if p]
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    rows: list[LoadRow] = []
    for variant in args.variants.split(","):
        if variant not in ("uniform", "hot"):
            ap.error(f"unknown variant {variant!r}")
        rows += run_variant(variant, args)
    summary = {"args": args_dict(args), "results": [asdict(r) for r in rows]}
    if args.repeat > 1:
        middle = repeat_medians(rows)
        print(f"medians over {args.repeat} repeats:")
        print_table(middle, COLUMNS)
        summary["medians"] = [asdict(r) for r in middle]
    summary["ratios"] = ratios(rows)
    for key, entry in summary["ratios"].items():
        print(f"{key}: " + ", ".join(f"{k} {v:.2f}" for k, v in entry.items()))
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
