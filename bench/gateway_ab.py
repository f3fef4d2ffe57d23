"""The gateway's own cost side by side: this tree's gateway, a baseline checkout's, and direct.

Starts zero-compute sim workers and two gateways over them, one from this tree and one from
`--baseline DIR` (a checkout of another commit), and measures the three targets in alternating
rounds within one run: p50 latency at 1 client, req/s at 64 clients, and each gateway's CPU time
per request (utime + stime from /proc). On a shared machine the CPU time per request is the
steadier figure: wall-clock latency there also measures everyone else's load.

    git archive 6eabea4 | tar -x -C /tmp/kvgate-base    # the baseline: any older commit
    python -m bench.gateway_ab --baseline /tmp/kvgate-base
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from pathlib import Path

from bench.lib.closed_loop import ZERO_COMPUTE, measure
from bench.lib.proc_stats import cpu_seconds
from bench.lib.report import write_json
from harness.cluster import Cluster, ClusterSpec
from harness.proc import Proc


def start_baseline(c: Cluster, src: Path) -> Proc:
    """A gateway over the same workers, importing `gateway` from the checkout at `src`."""
    proc = c.make_gateway(1)
    # `python -m` puts the working directory first on sys.path: start it from the checkout.
    with contextlib.chdir(src):
        proc.start()
    proc.wait_healthy(c.spec.startup_timeout)
    return proc


def run_round(
    targets: dict[str, tuple[list[str], Proc | None]], n: int, conc: int, k: int = 0
) -> dict:
    """One round over every target, starting from the `k`th: rounds rotate the order, so a
    load that drifts within a round falls on each target alike."""
    names = list(targets)
    out = {}
    for name in names[k % len(names) :] + names[: k % len(names)]:
        urls, proc = targets[name]
        cpu0 = cpu_seconds(proc.popen.pid) if proc and proc.popen else None
        load = measure(name, urls, n, conc)
        sent = n + min(n, 2 * conc)  # measure() sends a warm-up first
        row = {"p50_ms": load.p50_ms, "req_s": load.requests_per_s, "failed": load.failed}
        if cpu0 is not None and proc and proc.popen:
            row["cpu_ms_per_req"] = 1000 * (cpu_seconds(proc.popen.pid) - cpu0) / sent
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="checkout of the baseline commit")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1000, help="per 64-client round")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gateway_ab.json"))
    args = ap.parse_args()
    spec = ClusterSpec(
        workers=args.workers,
        engine="sim",
        worker_args=ZERO_COMPUTE,
        gateway_args=("--poll-interval", "0.5"),
        log_dir=Path("bench/results/logs/gateway_ab").resolve(),
    )
    rounds: dict[str, list[dict]] = {"1": [], "64": []}
    with Cluster(spec) as c:
        base = start_baseline(c, args.baseline.resolve())
        try:
            targets = {
                "direct": (c.worker_urls, None),
                "gateway (this tree)": ([c.gateway_url], c.gateways[0]),
                "gateway (baseline)": ([base.url], base),
            }
            for k in range(args.rounds):
                rounds["1"].append(run_round(targets, args.requests // 4, 1, k))
                rounds["64"].append(run_round(targets, args.requests, 64, k))
        finally:
            base.kill()
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds}
    print(f"median of {args.rounds} alternating rounds")
    print(
        f"{'target':<22}{'clients':>8}{'p50 ms':>9}{'req/s':>9}{'/ direct':>10}{'cpu ms/req':>12}"
    )
    for conc, rows in rounds.items():
        med = {
            name: {k: statistics.median(r[name][k] for r in rows) for k in rows[0][name]}
            for name in rows[0]
        }
        summary[f"median_{conc}"] = med
        for name, m in med.items():
            ratio = m["req_s"] / med["direct"]["req_s"]
            cpu = f"{m['cpu_ms_per_req']:.3f}" if "cpu_ms_per_req" in m else "-"
            print(
                f"{name:<22}{conc:>8}{m['p50_ms']:>9.2f}{m['req_s']:>9.1f}{ratio:>10.2f}{cpu:>12}"
            )
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
