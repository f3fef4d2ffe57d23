"""How many replicas can one gateway front? 64 to 512 simulated replicas behind 1 and 4 gateways.

For each fleet size N: one `harness.fleet` process serves N replicas (GPU-like timing, each its
own port, cache and event stream), and the trace is sized to it: 1.5 N tenants with ~2,600-token
system prompts, 2 users each, 3 turns, and caches that together hold `--cache-share` times the
trace's working set (4/3 by default: each replica a third of the working set of a four-replica
slice, as `bench.under_load` sizes its four workers). For each gateway count the gateways are
started on the fleet, measured idle, then serve the whole trace with open-loop (Poisson) arrivals
at each rate of `--rates`, cache_aware, from cold caches; then once with round_robin. A fleet of
one replica holding all N caches serves the trace alone: the single-cache bound.

Per point: hit rate (reported cached / prompt tokens) and its ratio to round robin and to the
bound; predicted == reported; latency; gateway CPU (utime + stime of the gateway processes, from
/proc) per request, of their ingestion threads per 1,000 events, and idle per second; KV-event lag
p99 (worker stamp to index); routing decision p50/p99; RSS; whether every gateway's index equals
every replica's cache once the point is over (digests, at a quiet point); whether the gateways
kept up (no failure, the rate achieved, event lag under a second).

The one fleet process answers every replica's polls, which N real workers would share: with more
than one gateway, the gateways split `--fleet-polls-per-second` (100, one gateway's default) and
`--fleet-tail-checks-per-second` (50) among them (bench/lib/fleet_args.py:fleet_budget), so the
fleet answers as many polls for 8 gateways as for one (0: every gateway at its own default).

    python -m bench.fleet_scale                                  # the whole matrix (hours)
    python -m bench.fleet_scale --replicas 512 --gateways 4 --rates 10,20,40
    python -m bench.fleet_scale --replicas 512 --gateways 1,4 --rates 60 --peers off,on --no-rr
    python -m bench.fleet_scale --replicas 32,512 --gateways 1 --rates 10 --no-bound
    python -m bench.fleet_scale --replicas 64 --rates 10 --baseline /tmp/kvgate-before
    python -m bench.fleet_scale --idle-only --replicas 32,512 --baseline /tmp/a --baseline /tmp/b
    python -m bench.fleet_scale --replicas 64 --gateways 4 --rates 60 --peers on --no-rr \\
        --no-bound --kill-gateway 10,5     # each rate also with gateway 0 killed at 10 s, 5 s down
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import httpx

from bench.lib import fleet_probe as probe
from bench.lib.fleet_args import fleet_budget, parser, quiet_timeout
from bench.lib.fleet_rows import COLUMNS, IDLE_COLUMNS, IdleRow, PointRow, make_row
from bench.lib.fleet_trace import FleetTrace, TraceShape, build_trace
from bench.lib.gateway_kill import GatewayKiller, print_windows, windows
from bench.lib.report import args_dict, print_table, write_json
from cachekey.headers import POLICY_HEADER
from harness.cluster import ClusterSpec
from harness.fleet.engine import Timing
from harness.fleet.model import FleetModel
from harness.fleet.process import FleetCluster, FleetProc, FleetSpec
from harness.open_loop import Outcome, Target, describe_progress, run_open_loop, usage_of

IDLE_SETTLE_S = 5.0


def drive(gateways: list[str], trace: FleetTrace, rate: float, policy: str, seed: int):
    def progress(outcomes: list[Outcome], elapsed: float) -> None:
        print(describe_progress(outcomes, elapsed), flush=True)

    return asyncio.run(
        run_open_loop(
            gateways,
            trace.requests,
            rate,
            seed=seed,
            headers={POLICY_HEADER: policy},
            progress=progress,
        )
    )


def run_point(
    c: FleetCluster,
    client: httpx.Client,
    trace: FleetTrace,
    rate: float,
    policy: str,
    label: str,
    args: argparse.Namespace,
    base: list[Outcome] | None = None,  # given: the point again, one gateway killed mid-run
    keep: dict[float, list[Outcome]] | None = None,  # the outcomes, by rate
) -> PointRow:
    assert c.fleet is not None and c.fleet.pid is not None
    probe.reset_caches(client, c.worker_urls, c.gateways)
    killer = GatewayKiller(c.gateways[0], args.kill_gateway) if base is not None else None
    label += " kill" if killer else ""
    print(f"{label}: {policy} at {rate:g} req/s ...", flush=True)
    before = probe.read(client, c.gateways, c.fleet.pid)
    if killer:
        killer.start()
    outcomes = drive([g.url for g in c.gateways], trace, rate, policy, args.seed)
    if killer:
        killer.join()
        base_windows = windows(base, len(c.gateways), 0, 5.0)
        print_windows(base_windows, windows(outcomes, len(c.gateways), 0, 5.0), killer)
    after = probe.read(client, c.gateways, c.fleet.pid)
    if keep is not None:
        keep[rate] = outcomes
    errors = Counter(o.error or f"status {o.status}" for o in outcomes if not o.ok)
    for error, n in errors.most_common(5):
        print(f"  {n} failed: {error[:200]}", flush=True)
    equal, settle, diff = probe.wait_indexes_equal(
        client, c.gateways, c.worker_urls, quiet_timeout(len(c.worker_urls), len(c.gateways), args)
    )
    if not equal:
        print(f"  indexes differ from the caches after {settle:.0f}s: {diff}", flush=True)
    return make_row(label, len(c.worker_urls), policy, rate, outcomes, before, after, equal, settle)


def bound_hit_rate(trace: FleetTrace, replicas: int, blocks: int, log_dir: Path) -> float:
    """The trace served in order by one replica holding all `replicas` caches."""
    fleet = FleetProc.create(FleetSpec(1, replicas * blocks, Timing(0.0, 0.0, 0.0)), log_dir)
    try:
        (url,) = fleet.start(120)

        async def serve() -> float:
            target, cached, prompt = Target(url, {}), 0, 0
            for req in trace.requests:
                status, _, body = await target.post(req.body)
                if status != 200:
                    raise RuntimeError(f"the bound's replica answered {status}: {body[:200]!r}")
                tokens, hit = usage_of(body)
                cached, prompt = cached + hit, prompt + tokens
            target.close()
            return cached / prompt

        return asyncio.run(serve())
    finally:
        fleet.kill()


def run_fleet(n: int, model: FleetModel, args: argparse.Namespace) -> list[PointRow | IdleRow]:
    shape = TraceShape(
        users_per_tenant=args.users_per_tenant, turns=args.turns, system_words=args.system_words
    )
    trace = build_trace(n, shape, model)
    if args.max_requests:
        trace.requests = trace.requests[: args.max_requests]  # a quick look: mostly first turns
    blocks = trace.blocks_per_replica(n, args.cache_share)
    timing = Timing(args.prefill_s_per_token, args.decode_s_per_step, args.step_s)
    log_dir = (args.log_dir / f"n{n}").resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    bound = None
    if args.bound and not args.idle_only:
        bound = bound_hit_rate(trace, n, blocks, log_dir)
        print(f"N={n}: single-cache bound ({n} x {blocks} blocks): hit {bound:.1%}", flush=True)
    rows: list[PointRow | IdleRow] = []
    for g in args.gateways:
        variants = [
            (f"{name}{g}gw{' peers' if peers else ''}", src, peers)
            for name, src in [("", None), *((f"{b.name} ", b) for b in args.baseline)]
            for peers in (args.peers if g > 1 else [False])
        ]
        spec = ClusterSpec(
            workers=0,
            gateways=g,
            gateway_args=(*fleet_budget(g, args), *args.gateway_args),
            log_dir=log_dir,
            peers=variants[0][2],
        )
        t0 = time.monotonic()
        with FleetCluster(spec, FleetSpec(n, blocks, timing)) as c, httpx.Client() as client:
            for i, (label, src, peers) in enumerate(variants):
                if i:  # the first variant's gateways started with the fleet
                    t0 = time.monotonic()
                    c.spec.peers, c.peer_ports = peers, []
                    try:
                        c.start_gateways(src)
                    except TimeoutError as e:  # its /health never said a worker is healthy
                        print(f"N={n} {label}: {str(e).splitlines()[0]}", flush=True)
                        rows.append(IdleRow(n, label, None, None, 0.0))
                        continue
                rows += run_variant(c, client, trace, label, t0, args, bound, blocks)
    return rows


def run_variant(
    c: FleetCluster,
    client: httpx.Client,
    trace: FleetTrace,
    label: str,
    t0: float,
    args: argparse.Namespace,
    bound: float | None,
    blocks: int,
) -> list[PointRow | IdleRow]:
    """One set-up of gateways: idle, then each rate cache_aware, then round robin (unless
    --no-rr)."""
    idle = measure_idle(c, client, label, t0, args)
    if idle.ready_s is None or args.idle_only:
        return [idle]
    kept: dict[float, list[Outcome]] = {}
    block = [
        run_point(c, client, trace, rate, "cache_aware", label, args, keep=kept)
        for rate in args.rates
    ]
    if args.kill_gateway and len(c.gateways) > 1:
        for rate in args.rates:
            block.append(run_point(c, client, trace, rate, "cache_aware", label, args, kept[rate]))
    rr = None
    if args.rr:
        rr = run_point(c, client, trace, args.rr_rate or args.rates[0], "round_robin", label, args)
        block.append(rr)
    for row in block:
        row.finish(idle.idle, rr.hit_rate if rr else 0.0, bound, blocks)
    print_table(block, COLUMNS)
    return [idle, *block]


def measure_idle(
    c: FleetCluster, client: httpx.Client, label: str, t0: float, args: argparse.Namespace
) -> IdleRow:
    """Once every gateway is ready, and 5 s more: each one's CPU per second with no request
    (polls, event tail checks), over `--idle-seconds`. A set-up not ready in `--ready-timeout`
    is a row too."""
    assert c.fleet is not None and c.fleet.pid is not None
    n = len(c.worker_urls)
    try:
        probe.wait_ready(client, c.gateways, n, args.ready_timeout)
    except TimeoutError as e:
        print(f"N={n} {label}: {e}", flush=True)
        return IdleRow(n, label, None, None, 0.0)
    ready = time.monotonic() - t0
    pids = ", ".join(str(g.pid) for g in c.gateways)
    print(f"N={n} {label}: ready in {ready:.0f}s (pids {pids}, the fleet's {c.fleet.pid})")
    time.sleep(IDLE_SETTLE_S)  # the first polls and tail checks after the start are done
    before = probe.read(client, c.gateways, c.fleet.pid)
    time.sleep(args.idle_seconds)
    after = probe.read(client, c.gateways, c.fleet.pid)
    idle = after.cpu_since(before) / (after.at - before.at) / len(c.gateways)
    row = IdleRow(n, label, round(ready, 1), idle, max(after.rss) / 2**20)
    print_table([row], IDLE_COLUMNS)
    return row


def main() -> None:
    args = parser(__doc__).parse_args()
    model = FleetModel.load("demo", "demo")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    rows: list[PointRow | IdleRow] = []
    for n in args.replicas:
        rows += run_fleet(n, model, args)
        idle = [asdict(r) for r in rows if isinstance(r, IdleRow)]
        points = [asdict(r) for r in rows if isinstance(r, PointRow)]
        write_json(args.out, {"args": args_dict(args), "idle": idle, "points": points})


if __name__ == "__main__":
    main()
