r"""One torch worker's throughput against concurrency, this tree beside a baseline checkout.

Two clusters of `--workers` torch workers (demo model, CPU) and a gateway each, one started from
this tree and one from `--baseline DIR` (`python -m` imports from the working directory), serve
bench.ttft's streamed chat workload (round_robin) at each `--concurrency`, in rounds that rotate
which tree goes first. Each run reports requests/s, output tokens/s and TTFT, and the CPU time
(utime + stime from /proc) its workers (each with its engine core processes), its gateway and
the client (this process) spent per request: on a shared machine the CPU time is the steadier
figure, wall-clock rates also measure everyone else's load.

    git archive main | tar -x -C /tmp/kvgate-base            # the baseline: any older commit
    python -m bench.worker_ab --baseline /tmp/kvgate-base     # -> bench/results/worker_ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import httpx

from bench.lib.proc_stats import cpu_seconds, tree_cpu_seconds
from bench.lib.report import write_json
from bench.lib.runs import add_workload_args, drive_policy, workload_spec
from bench.ttft import make_cluster, make_row
from harness.cluster import Cluster
from harness.workload import Workload

TREES = ("this tree", "baseline")


def cpu_of(cluster: Cluster) -> tuple[float, float]:
    """CPU seconds of the cluster's workers (together, each with its engine core processes)
    and of its gateway."""
    workers = sum(tree_cpu_seconds(w.popen.pid) for w in cluster.workers if w.popen)
    gateway = cluster.gateways[0].popen
    return workers, cpu_seconds(gateway.pid) if gateway else 0.0


def first_calls(urls: list[str]) -> None:
    """One short request per worker, so first-call costs (allocator, kernels) are not measured
    (and the workload's prefixes are not cached before its rounds)."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2}
    for u in urls:
        httpx.post(f"{u}/v1/chat/completions", json=body, timeout=120).raise_for_status()


def run_once(cluster: Cluster, workload: Workload, concurrency: int) -> dict:
    w0, g0 = cpu_of(cluster)
    c0 = time.process_time()  # the client: this process drives the workload
    m = drive_policy(cluster, workload, "round_robin", concurrency=concurrency, stream=True)
    c1 = time.process_time()
    w1, g1 = cpu_of(cluster)
    row = make_row("round_robin", m)
    n = row.requests
    return {
        "requests": n,
        "req_s": row.requests_per_s,
        "out_tok_s": row.output_tokens_per_s,
        "ttft_p50_ms": row.ttft_p50_ms,
        "ttft_p90_ms": row.ttft_p90_ms,
        "failed": row.failed,
        "worker_cpu_ms_per_req": round(1000 * (w1 - w0) / n, 2),
        "gateway_cpu_ms_per_req": round(1000 * (g1 - g0) / n, 2),
        "client_cpu_ms_per_req": round(1000 * (c1 - c0) / n, 2),
    }


def summarize(runs: list[dict], concurrencies: list[int]) -> dict:
    """Medians per tree and concurrency, and each tree's req/s against its own at the first."""
    out: dict = {}
    for tree in TREES:
        per_c = {}
        for c in concurrencies:
            rows = [r for r in runs if r["tree"] == tree and r["concurrency"] == c]
            keys = [k for k in rows[0] if k not in ("tree", "concurrency", "round")]
            per_c[c] = {k: statistics.median(r[k] for r in rows) for k in keys}
        base = per_c[concurrencies[0]]["req_s"]
        for c in concurrencies:
            per_c[c]["req_s_vs_first"] = round(per_c[c]["req_s"] / base, 2) if base else 0.0
        out[tree] = per_c
    return out


def print_row(r: dict) -> None:
    print(
        f"{r['tree']:<10} {r['concurrency']:>4} {r['round']:>5} {r['req_s']:>7.2f} "
        f"{r['out_tok_s']:>9.1f} {r['ttft_p50_ms']:>9.0f} {r['ttft_p90_ms']:>9.0f} "
        f"{r['worker_cpu_ms_per_req']:>11.1f} {r['gateway_cpu_ms_per_req']:>10.1f} "
        f"{r['client_cpu_ms_per_req']:>10.1f}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="checkout of the baseline commit")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--num-blocks", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--tenants", type=int, default=2)
    add_workload_args(ap)
    ap.set_defaults(users_per_tenant=16, seed=5)  # issue 35's workload: 96 requests
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("bench/results/worker_ab.json"))
    args = ap.parse_args()
    args.engine, args.model, args.device, args.dtype = "torch", "demo", "cpu", "auto"
    args.gpu_memory_utilization = None
    # make_cluster passes these on: both trees' gateways and workers as built.
    args.gateway_arg, args.worker_arg = [], []
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workload = Workload(workload_spec(args, args.tenants, max_tokens=args.max_tokens))
    logs = Path("bench/results/logs/worker_ab").resolve()
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        args.log_dir = logs / "this"
        clusters = {TREES[0]: stack.enter_context(make_cluster(args, "demo"))}
        args.log_dir = logs / "baseline"
        with contextlib.chdir(args.baseline.resolve()):
            clusters[TREES[1]] = stack.enter_context(make_cluster(args, "demo"))
        for c in clusters.values():
            first_calls(c.worker_urls)
        print(
            "tree       conc round   req/s out tok/s  TTFT p50  TTFT p90 wkr cpu/req "
            "gw cpu/req cli cpu/req"
        )
        for k in range(args.rounds):
            for i, conc in enumerate(concurrencies):
                order = TREES if (k + i) % 2 == 0 else TREES[::-1]
                for tree in order:
                    row = {"tree": tree, "concurrency": conc, "round": k}
                    row |= run_once(clusters[tree], workload, conc)
                    print_row(row)
                    runs.append(row)
    summary = summarize(runs, concurrencies)
    for tree, per_c in summary.items():
        for conc, m in per_c.items():
            print(
                f"median {tree:<10} conc {conc:>3}: {m['req_s']:.2f} req/s "
                f"({m['req_s_vs_first']:.2f}x conc {concurrencies[0]}), "
                f"{m['out_tok_s']:.0f} out tok/s, worker {m['worker_cpu_ms_per_req']:.1f} "
                f"CPU ms/req, gateway {m['gateway_cpu_ms_per_req']:.1f}, "
                f"client {m['client_cpu_ms_per_req']:.1f}"
            )
    args_out = {k: str(v) for k, v in vars(args).items()}
    write_json(args.out, {"args": args_out, "runs": runs, "medians": summary})


if __name__ == "__main__":
    main()
