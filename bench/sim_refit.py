r"""The sim preset's worker-server cost refitted to a device run of today's worker.

The `h200-llama-1b` preset's server cost (worker/engine/sim_presets.py: per request, per stream,
per uncached prompt token) is fitted to `bench.ttft` runs of the worker as it was at 99afd2c.
`bash bench/gpu.sh routing` (with `ROUTING_ONE=1` for one worker at 1, 4 and 16 streams) runs
the same workloads with today's worker. This reads each run's medians where the requests spread
evenly over the workers (round_robin and least_loaded) as server figures, the preset's own
kind: streams per worker (concurrency / workers), the prefix hit, and seconds per request on
one worker (workers / requests/s). It refits the three server coefficients on the preset's
engine fit, prints them beside the preset's with each figure's residual, and prints the rows to
put in sim_presets.py for a preset of today's worker.

The fit is the preset's: a request's server cost and its engine work add up on one worker
(`--sim-server-model step`). Should the device run's first-token parts put the host work in
its API server instead (bench.ttft's "to engine"; `apart`, where the two overlap), the figures
say how long a request takes, not how the two parts share it, and these terms understate the
API server's (when the two overlap, a worker bound by its host takes its host work per request,
not that less the engine's).

    python -m bench.sim_refit --gpu-results /tmp/out      # bench/results/sim_refit.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from bench.lib.report import args_dict, write_json
from worker.engine.sim_presets import H200_LLAMA_1B_SERVER, capacity_seconds, fit

EVEN = ("round_robin", "least_loaded")  # the policies whose requests spread evenly
SERVER = ("server_request", "server_stream", "server_token")
Figure = tuple[str, int, float, float]  # (name, streams per worker, hit, seconds per request)


def server_figures(results: Path) -> list[Figure]:
    """The server figures of every `routing-<run>.json` in `results` (bench.ttft's JSON)."""
    rows: list[Figure] = []
    for path in sorted(results.glob("routing-*.json")):
        data = json.loads(path.read_text())
        workers, concurrency = int(data["args"]["workers"]), int(data["args"]["concurrency"])
        run = path.stem.removeprefix("routing-")
        for m in data["medians"]:
            if m["policy"] in EVEN and m["requests_per_s"] > 0:
                streams = max(concurrency // workers, 1)
                seconds = workers / m["requests_per_s"]
                rows.append((f"{run} {m['policy']}", streams, round(m["hit_rate"], 3), seconds))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--gpu-results", type=Path, required=True, help="a `bash bench/gpu.sh routing` run's $OUT"
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/sim_refit.json"))
    args = ap.parse_args()
    figures = server_figures(args.gpu_results)
    if len(figures) < len(SERVER):
        sys.exit(
            f"sim_refit: {len(figures)} server figures in {args.gpu_results} (round_robin or "
            f"least_loaded medians of routing-*.json); the fit needs at least {len(SERVER)}"
        )
    before, after = fit(), fit(server=figures)
    print(f"server figures from {args.gpu_results} (streams per worker, hit, s/request):")
    for name, streams, hit, seconds in figures:
        print(f"    ({name!r}, {streams}, {hit}, {seconds:.5f}),")
    print(f"{'coefficient':16} {'preset':>10} {'refitted':>10}")
    for k, unit, scale in zip(SERVER, ("ms", "ms", "us"), (1e3, 1e3, 1e6), strict=True):
        old, new = getattr(before, k) * scale, getattr(after, k) * scale
        print(f"{k:16} {old:8.2f}{unit} {new:8.2f}{unit}")
    print(f"{'figure':32} {'measured':>10} {'refitted':>10} {'error':>7} {'preset':>10}")
    residuals = []
    for name, streams, hit, seconds in figures:
        model, old = capacity_seconds(after, streams, hit), capacity_seconds(before, streams, hit)
        error = (model - seconds) / seconds
        residuals.append({"figure": name, "measured": seconds, "refitted": model, "preset": old})
        print(
            f"{name:32} {seconds * 1e3:8.2f}ms {model * 1e3:8.2f}ms {error:+7.1%}"
            f" {old * 1e3:8.2f}ms"
        )
    summary = {
        "args": args_dict(args),
        "figures": figures,
        "preset_figures": H200_LLAMA_1B_SERVER,
        "preset": asdict(before),
        "refitted": asdict(after),
        "residuals": residuals,
    }
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
