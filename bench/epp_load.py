"""The EPP under load: open-loop text chats at fixed rates through every path, in one run.

bench.epp_overhead measures one request at a time; this sends Poisson arrivals at each of
`--rates` (100, 300, 500 requests/s) for `--seconds` through, in turn:

- direct: straight to the two sim workers (zero compute time), alternating;
- HTTP gateway: one `python -m gateway`;
- plain Envoy: Envoy round robin over the workers, no ext_proc;
- Envoy + 1 EPP: Envoy asking one kvgate EPP (`--epp`), the ORIGINAL_DST shape (harness/envoy.py);
- Envoy + 2 EPPs: one Envoy balancing its ext_proc streams over two EPP replicas that are peers
  (`--peer-port`, `--peers`), as the chart deploys them.

Each path's latency is the client's, from sending to the last byte; "added" is a path's
percentile minus direct's at the same rate and round. The paths run one after another within a
round, in a rotated order each round. Per path the CPU seconds of its kvgate processes per
request (from /proc) say how close one Python process is to its limit: at 1.0 core it is.

    python -m bench.epp_load                        # 100,300,500 req/s, 10 s each, 2 rounds
    python -m bench.epp_load --rates 300 --seconds 20 --rounds 3
    python -m bench.epp_load --profile              # then py-spy on the one EPP at the top rate

`--profile` (needs `.venv/bin/pip install py-spy`) serves the highest rate once more through
Envoy + 1 EPP while py-spy samples the EPP process, and prints where its time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

from bench.epp_overhead import GATEWAY_ARGS
from bench.lib import pyspy
from bench.lib.closed_loop import ZERO_COMPUTE
from bench.lib.proc_stats import cpu_seconds
from bench.lib.report import args_dict, percentile, write_json
from harness.cluster import Cluster, ClusterSpec
from harness.envoy import Envoy
from harness.envoy_config import EnvoySpec
from harness.open_loop import TraceRequest, run_open_loop
from harness.ports import HOST, free_port
from harness.proc import Proc

HEADER = (
    "| req/s | round | path | p50 / p95 / p99 ms | added p50 / p95 / p99 ms | achieved req/s | "
    "failed | kvgate CPU ms/req | kvgate cores | client late p99 ms |"
)


def trace(n: int, tag: str) -> list[TraceRequest]:
    """`n` distinct short text chats (each its own conversation: nothing waits on another)."""
    out = []
    for i in range(n):
        content = f"{tag} question {i}: a short question about caches " + "and keys " * 20
        body = {"model": "demo", "messages": [{"role": "user", "content": content}]}
        out.append(TraceRequest(i, json.dumps({**body, "max_tokens": 1}).encode()))
    return out


def start_epps(c: Cluster, n: int, log_dir: Path, stack: contextlib.ExitStack) -> list[Proc]:
    """`n` EPP processes over the cluster's workers; with 2 or more, peers of each other."""
    grpc = [free_port() for _ in range(n)]
    peer_ports = [free_port() for _ in range(n)] if n > 1 else []
    peers = ",".join(f"{HOST}:{p}" for p in peer_ports)
    env = {"KVGATE_WORKER_TOKEN": c.spec.worker_token} if c.spec.worker_token else {}
    procs = []
    for i in range(n):
        http = free_port()
        args = ["-m", "gateway", "--workers", ",".join(c.worker_urls), "--host", HOST,
                "--port", str(http), "--epp", "--epp-port", str(grpc[i])]  # fmt: skip
        args += GATEWAY_ARGS
        if peer_ports:
            args += ["--peer-port", str(peer_ports[i]), "--peers", peers]
        name = f"epp{n}-{i}"
        proc = Proc(name, args, http, log_dir / f"{name}.log", env=env)
        proc.start()
        stack.callback(proc.kill)
        procs.append(proc)
    for proc in procs:
        proc.wait_healthy(120)
    return procs


def run_path(urls: list[str], pids: list[int], rate: float, args: argparse.Namespace, tag: str):
    n = int(rate * args.seconds)
    cpu0 = sum(cpu_seconds(p) for p in pids)
    t0 = time.monotonic()
    outcomes = asyncio.run(run_open_loop(urls, trace(n, tag), rate, seed=args.seed, timeout=30))
    wall = time.monotonic() - t0
    cpu = sum(cpu_seconds(p) for p in pids) - cpu0
    ok = [o for o in outcomes if o.ok]
    ms = [(o.done - o.sent) * 1000 for o in ok]
    late = [(o.sent - o.due) * 1000 for o in outcomes]  # the client falling behind its schedule
    span = max((o.done for o in ok), default=0.0) - min((o.sent for o in ok), default=0.0)
    return {
        "p50": percentile(ms, 0.5), "p95": percentile(ms, 0.95), "p99": percentile(ms, 0.99),
        "failed": len(outcomes) - len(ok), "achieved_rps": len(ok) / span if span else 0.0,
        "client_late_p99_ms": percentile(late, 0.99),
        "cpu_per_request_ms": 1000 * cpu / max(len(ok), 1), "cores": cpu / wall,
    }  # fmt: skip


def run_all(paths: dict[str, tuple[list[str], list[int]]], args: argparse.Namespace) -> list:
    rows = []
    names = list(paths)
    for rate in args.rates:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            got = {}
            for name in order:
                urls, pids = paths[name]
                got[name] = run_path(urls, pids, rate, args, f"{rate}-{r}-{name}")
            for name in names:
                row = {"rate": rate, "round": r + 1, "path": name, **got[name]}
                for q in ("p50", "p95", "p99"):
                    row[f"added_{q}"] = got[name][q] - got["direct"][q]
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def profile(urls: list[str], pid: int, args: argparse.Namespace, log_dir: Path) -> dict:
    """The top rate through `urls` once more, with py-spy sampling `pid` (the EPP) meanwhile."""
    rate, out = max(args.rates), log_dir / "epp.pyspy.txt"
    spy = pyspy.record(pid, args.seconds, out)
    row = run_path(urls, [pid], rate, args, "profile")
    spy.wait(timeout=args.seconds + 30)
    top = pyspy.summarize(out)
    print(f"py-spy on the EPP at {rate:g} req/s ({row['cores']:.2f} cores): {json.dumps(top)}")
    return {"rate": rate, **row, "pyspy": top}


def _line(row: dict) -> str:
    return (
        f"| {row['rate']:g} | {row['round']} | {row['path']} | {row['p50']:.2f} / "
        f"{row['p95']:.2f} / {row['p99']:.2f} | {row['added_p50']:.2f} / {row['added_p95']:.2f}"
        f" / {row['added_p99']:.2f} | {row['achieved_rps']:.0f} | {row['failed']} | "
        f"{row['cpu_per_request_ms']:.2f} | {row['cores']:.2f} | {row['client_late_p99_ms']:.1f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--rates", type=floats, default=[100.0, 300.0, 500.0])
    ap.add_argument("--seconds", type=float, default=10.0, help="per path, rate and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="py-spy on the EPP at the top rate")
    ap.add_argument("--out", type=Path, default=Path("bench/results/epp_load.json"))
    args = ap.parse_args()
    log_dir = Path("bench/results/logs/epp_load")
    spec = ClusterSpec(workers=2, engine="sim", worker_args=ZERO_COMPUTE,
                       gateway_args=GATEWAY_ARGS, log_dir=log_dir)  # fmt: skip
    with contextlib.ExitStack() as stack:
        c = stack.enter_context(Cluster(spec))
        one, two = start_epps(c, 1, log_dir, stack), start_epps(c, 2, log_dir, stack)
        envoys = {}
        for name, epps in (("one", one), ("two", two)):
            target = ",".join(f"{HOST}:{p.args[p.args.index('--epp-port') + 1]}" for p in epps)
            envoys[name] = stack.enter_context(
                Envoy(EnvoySpec(epp=target, log_dir=log_dir), name=f"envoy-{name}-epp")
            )
        plain = stack.enter_context(Envoy(EnvoySpec(epp="", workers=c.worker_urls,
                                                    ext_proc=False, log_dir=log_dir),
                                          name="envoy-plain"))  # fmt: skip
        worker_pids = [w.pid for w in c.workers if w.pid]
        paths = {
            "direct": (c.worker_urls, worker_pids),
            "HTTP gateway": ([c.gateway_url], [c.gateways[0].pid]),
            "plain Envoy": ([plain.url], []),
            "Envoy + 1 EPP": ([envoys["one"].url], [p.pid for p in one]),
            "Envoy + 2 EPPs": ([envoys["two"].url], [p.pid for p in two]),
        }
        time.sleep(2.0)  # every process has polled the workers
        for name, (urls, _) in paths.items():  # warm: assets loaded, connections open
            run_path(urls, [], 50, argparse.Namespace(seconds=1.0, seed=1), f"warm-{name}")
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        print(HEADER)
        rows = run_all(paths, args)
        urls, pids = paths["Envoy + 1 EPP"]
        prof = profile(urls, pids[0], args, log_dir) if args.profile else None
    result = {"args": args_dict(args), "load": os.getloadavg(), "rows": rows, "profile": prof}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
