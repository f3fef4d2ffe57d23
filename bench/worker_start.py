r"""How long a worker takes from its start to a healthy /health, this tree beside a baseline.

One worker at a time (the demo model, no gateway), each `--engines` engine, started from this
tree and from `--baseline DIR` (`python -m` imports from the working directory), in rounds that
rotate which tree goes first. Each start is timed from the Popen to the first 200 from /health
(polled every 10 ms), with the CPU seconds the worker and its engine core had spent by then
(utime + stime from /proc: on a shared machine the steadier figure). One unmeasured start of
each side first, so neither pays for a cold file cache. Every test and bench that starts a
cluster pays this once per worker.

    git archive main | tar -x -C /tmp/kvgate-base          # the baseline: any older commit
    python -m bench.worker_start --baseline /tmp/kvgate-base  # -> bench/results/worker_start.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import httpx

from bench.lib.proc_stats import tree_cpu_seconds
from bench.lib.report import write_json
from harness.cluster import Cluster, ClusterSpec
from worker.demo.model import ensure_demo_model

TREES = ("this tree", "baseline")


def time_start(tree: Path, engine: str, model: Path, log_dir: Path) -> tuple[float, float]:
    """Seconds from the worker's start to a healthy /health, and its CPU seconds by then."""
    spec = ClusterSpec(workers=1, gateways=0, engine=engine, model=str(model), log_dir=log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = Cluster(spec).make_worker(0)
    with contextlib.chdir(tree):
        t0 = time.monotonic()
        proc.start()
    try:
        while True:
            if not proc.alive():
                raise RuntimeError(f"the worker exited:\n{proc.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{proc.url}/health", timeout=1.0).status_code == 200:
                    break
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
        assert proc.popen is not None
        return elapsed, tree_cpu_seconds(proc.popen.pid)
    finally:
        proc.kill()


def summarize(runs: list[dict], engines: list[str]) -> dict:
    out: dict = {}
    for engine in engines:
        med = {
            tree: {
                key: statistics.median(
                    r[key] for r in runs if (r["tree"], r["engine"]) == (tree, engine)
                )
                for key in ("seconds", "cpu_seconds")
            }
            for tree in TREES
        }
        ratio = med[TREES[0]]["seconds"] / med[TREES[1]]["seconds"]
        out[engine] = {**med, "this_vs_baseline": ratio}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="checkout of the baseline commit")
    ap.add_argument("--engines", default="sim,torch")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench/results/worker_start.json"))
    args = ap.parse_args()
    engines = args.engines.split(",")
    trees = {TREES[0]: Path.cwd(), TREES[1]: args.baseline.resolve()}
    model = ensure_demo_model()
    logs = Path("bench/results/logs/worker_start").resolve()
    for tree in TREES:  # warm: the file cache, the demo model's pages
        for engine in engines:
            time_start(trees[tree], engine, model, logs / "warm")
    runs: list[dict] = []
    print("round tree       engine  start s  cpu s")
    for k in range(args.rounds):
        for tree in TREES if k % 2 == 0 else TREES[::-1]:
            for engine in engines:
                seconds, cpu = time_start(trees[tree], engine, model, logs / f"round-{k}")
                runs.append({"round": k, "tree": tree, "engine": engine, "seconds": seconds,
                             "cpu_seconds": cpu})  # fmt: skip
                print(f"{k:>5} {tree:<10} {engine:<6} {seconds:>8.2f} {cpu:>6.2f}", flush=True)
    summary = summarize(runs, engines)
    for engine, m in summary.items():
        this, base = m[TREES[0]], m[TREES[1]]
        print(
            f"median {engine:<6}: this tree {this['seconds']:.2f} s ({this['cpu_seconds']:.2f} "
            f"CPU s), baseline {base['seconds']:.2f} s ({base['cpu_seconds']:.2f} CPU s): "
            f"{m['this_vs_baseline']:.2f}x"
        )
    write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                          "medians": summary})  # fmt: skip


if __name__ == "__main__":
    main()
