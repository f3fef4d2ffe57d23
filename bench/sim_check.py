r"""The calibrated sim against the GPU's own end-to-end figures: requests/s and time to first
token side by side, and which policy wins each column on each.

The preset's coefficients are fitted to the H200's step times and to its requests/s per worker
(worker/engine/sim_presets.py); nothing in the fit holds the sim's first tokens to the GPU's.
This runs, in the sim, the `bench.ttft` runs the GPU figures come from
(/work/shared/reference/gpu-figures.md: one worker at 1, 4 and 16 streams; 4 workers on the
hot prefixes and on the docs' workload under round_robin and least_loaded), with the worker
server's cost as measured (`--sim-server-scale 1`), and prints each figure next to the sim's:
the sim's times divided by `--sim-time-scale` and its requests/s multiplied by it, so both are
in the GPU's seconds. A routing criterion judged in the sim is only as good as the sim's shape
in that column. Then where each run's mean first token goes in the sim (the gateway and HTTP,
the worker outside its engine, the engine's queue and prefill: bench/lib/first_token.py), and
the GPU run's beside it where `--gpu-results` has it: which part the sim gets wrong.

    python -m bench.sim_check                    # about 7 min; bench/results/sim_check.json
    python -m bench.sim_check --only hot,docs --rounds 3
    python -m bench.sim_check --gpu-results /tmp/out   # against a `bash bench/gpu.sh routing` run

With `--gpu-results DIR` (what `bash bench/gpu.sh routing` wrote, ROUTING_ONE=1 for the one
worker's runs) a run whose JSON is there is held to that run's medians, every policy it ran
(cache_aware too: today's router on the GPU against itself in the sim); the others keep
gpu-figures.md's. Its runs' worker CPU per request, in the API servers and in the engine cores,
is printed too: where the device's worker pays its host cost, so which `--sim-server-model`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.lib.first_token import Parts
from bench.lib.report import args_dict, col, columns, print_table, write_json
from worker.engine.config import SIM_SERVER_MODELS

ONE_WORKER = "--workers 1 --num-blocks 2000 --tenants 2 --users-per-tenant 16 --seed 5"
HOT = "--workers 4 --num-blocks 700 --tenants 2 --users-per-tenant 16 --concurrency 16 --seed 5"
DOCS = "--workers 4 --num-blocks 700 --tenants 12 --concurrency 8"

# The H200's figures (gpu-figures.md; the 4-worker runs' second round, as issue 36 quotes
# them): run name -> (bench.ttft's workload arguments, {policy: (req/s, TTFT p50 ms, p90 ms)}).
GPU_RUNS: dict[str, tuple[str, dict[str, tuple[float, float, float]]]] = {
    "one-c1": (f"{ONE_WORKER} --concurrency 1", {"round_robin": (12.1, 58, 70)}),
    "one-c4": (f"{ONE_WORKER} --concurrency 4", {"round_robin": (11.7, 159, 843)}),
    "one-c16": (f"{ONE_WORKER} --concurrency 16", {"round_robin": (10.2, 355, 5926)}),
    "hot": (HOT, {"round_robin": (54.2, 181, 274), "least_loaded": (55.4, 175, 251)}),
    "docs": (DOCS, {"round_robin": (25.6, 144, 274), "least_loaded": (26.4, 180, 258)}),
}
Figures = dict[str, tuple[float, float, float]]  # policy -> (req/s, TTFT p50 ms, TTFT p90 ms)


@dataclass(slots=True)
class Row:
    run: str = col("run", 8, left=True)
    policy: str = col("policy", 13, left=True)
    gpu_rps: float = col("GPU req/s", 10, ".1f", sep=" |")
    sim_rps: float = col("sim", 7, ".1f")
    rps_ratio: float = col("sim/GPU", 8, ".2f")
    gpu_p50_ms: float = col("GPU p50", 10, ".0f", "ms", sep=" |")
    sim_p50_ms: float = col("sim", 8, ".0f", "ms")
    p50_ratio: float = col("sim/GPU", 8, ".2f")
    gpu_p90_ms: float = col("GPU p90", 10, ".0f", "ms", sep=" |")
    sim_p90_ms: float = col("sim", 8, ".0f", "ms")
    p90_ratio: float = col("sim/GPU", 8, ".2f")


COLUMNS = columns(Row)
# column -> (Row's GPU and sim attributes, whether higher wins)
SHAPE_COLUMNS = {
    "req/s": ("gpu_rps", "sim_rps", True),
    "TTFT p50": ("gpu_p50_ms", "sim_p50_ms", False),
    "TTFT p90": ("gpu_p90_ms", "sim_p90_ms", False),
}


def gpu_figures(name: str, results: Path | None) -> tuple[Figures, str]:
    """A run's GPU figures and where they come from: the medians of its JSON in `results`
    (a `bash bench/gpu.sh routing` run) when there is one, else gpu-figures.md's."""
    # `bash bench/gpu.sh routing` names each run's bench.ttft JSON routing-<run>.json.
    path = results / f"routing-{name}.json" if results is not None else None
    if path is None or not path.exists():
        return GPU_RUNS[name][1], "gpu-figures.md"
    medians = json.loads(path.read_text())["medians"]
    return {
        m["policy"]: (m["requests_per_s"], m["ttft_p50_ms"], m["ttft_p90_ms"]) for m in medians
    }, str(path)


@dataclass(slots=True)
class PartsRow(Parts):
    """A run's mean first token in parts (bench/lib/first_token.py), in the GPU's seconds: whose
    run it is, and on which side (the GPU or the sim)."""

    run: str = col("run", 8, left=True)
    side: str = col("on", 4, left=True)


PARTS = ("client_ms", "to_worker_ms", "to_engine_ms", "queue_ms", "prefill_ms")
_PART_COLUMNS = {c.attr: c for c in columns(PartsRow)}
PARTS_COLUMNS = tuple(_PART_COLUMNS[a] for a in ("run", "policy", "side", *PARTS))


def parts_rows(name: str, side: str, path: Path, scale: float = 1.0) -> list[PartsRow]:
    """A bench.ttft JSON's median parts per policy (none from a JSON without them), divided by
    `scale` (the sim's time scale)."""
    medians = json.loads(path.read_text()).get("first_token_parts", [])
    return [
        PartsRow(
            p["policy"],
            -1,
            *(None if p[k] is None else p[k] / scale for k in PARTS),
            run=name,
            side=side,
        )
        for p in medians
        if p["round"] == -1
    ]


def host_cpu(name: str, path: Path) -> list[dict]:
    """A device run's worker CPU per request by policy (its medians): in the workers' API
    servers and in their engine cores, which says where today's worker pays its host cost and so
    which `--sim-server-model` it is (none from a JSON older than bench.ttft's CPU columns)."""
    return [
        {
            "run": name,
            "policy": m["policy"],
            "server_cpu_ms": m["server_cpu_ms"],
            "core_cpu_ms": m["core_cpu_ms"],
        }
        for m in json.loads(path.read_text())["medians"]
        if "server_cpu_ms" in m
    ]


def run_sim(name: str, policies: list[str], args: argparse.Namespace, out: Path) -> dict[str, dict]:
    """One GPU run's workload in the sim under `policies`: bench.ttft's medians by policy (its
    JSON left at `out`)."""
    workload = GPU_RUNS[name][0]
    cmd = [sys.executable, "-m", "bench.ttft", "--engine", "sim", *workload.split()]
    cmd += ["--policies", ",".join(policies), "--rounds", str(args.rounds)]
    cmd += ["--sim-preset", args.sim_preset, "--sim-server-scale", "1"]
    cmd += [f"--worker-arg=--sim-server-model={args.sim_server_model}"]
    cmd += ["--sim-time-scale", str(args.sim_time_scale), "--out", str(out)]
    cmd += ["--log-dir", str(args.log_dir / name)]
    print(f"{name}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return {m["policy"]: m for m in json.loads(out.read_text())["medians"]}


def make_row(name: str, policy: str, gpu: Figures, sim: dict, scale: float) -> Row:
    """The GPU's figure and the sim's medians, in the GPU's seconds."""
    rps, p50, p90 = gpu[policy]
    s_rps = sim["requests_per_s"] * scale
    s_p50, s_p90 = sim["ttft_p50_ms"] / scale, sim["ttft_p90_ms"] / scale
    return Row(
        name, policy, rps, s_rps, s_rps / rps, p50, s_p50, s_p50 / p50, p90, s_p90, s_p90 / p90
    )


def shapes(rows: list[Row]) -> list[dict]:
    """For each run with several policies and each column: the winner on the GPU and in the sim,
    and by how much (the runner-up's figure over the winner's: 1.03 is a near tie)."""
    out = []
    for name in dict.fromkeys(r.run for r in rows):
        mine = [r for r in rows if r.run == name]
        if len(mine) < 2:
            continue
        for column, (gpu, sim, higher) in SHAPE_COLUMNS.items():
            entry = {"run": name, "column": column}
            for side, attr in (("gpu", gpu), ("sim", sim)):
                ranked = sorted(mine, key=lambda r: getattr(r, attr), reverse=higher)
                best, second = getattr(ranked[0], attr), getattr(ranked[1], attr)
                entry[side] = ranked[0].policy
                entry[f"{side}_margin"] = second / best if not higher else best / second
            entry["same"] = entry["gpu"] == entry["sim"]
            out.append(entry)
    return out


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default=",".join(GPU_RUNS), help="runs, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="bench.ttft's rounds per run")
    ap.add_argument("--sim-preset", default="h200-llama-1b")
    ap.add_argument(
        "--sim-time-scale",
        type=float,
        default=4.0,
        help="every sim step this many times the GPU's (the host's own CPU time then weighs "
        "less); results are scaled back",
    )
    ap.add_argument(
        "--sim-server-model",
        choices=SIM_SERVER_MODELS,
        default="step",
        help="where the sim worker charges its server's cost (the worker's flag)",
    )
    ap.add_argument(
        "--gpu-results",
        type=Path,
        help="a `bash bench/gpu.sh routing` run's $OUT: its runs' medians are the GPU figures",
    )
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/sim_check"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/sim_check.json"))
    args = ap.parse_args()
    unknown = set(args.only.split(",")) - set(GPU_RUNS)
    if unknown:
        ap.error(f"unknown runs {', '.join(sorted(unknown))}; known: {', '.join(GPU_RUNS)}")
    return args


def main() -> None:
    args = _arguments()
    rows: list[Row] = []
    parts: list[PartsRow] = []
    cpu: list[dict] = []
    sources: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            gpu, source = gpu_figures(name, args.gpu_results)
            print(f"{name}: the GPU's figures from {source}", flush=True)
            out = Path(tmp) / f"{name}.json"
            medians = run_sim(name, list(gpu), args, out)
            rows += [make_row(name, p, gpu, medians[p], args.sim_time_scale) for p in gpu]
            sources[name] = source
            if source != "gpu-figures.md":
                parts += parts_rows(name, "GPU", Path(source))
                cpu += host_cpu(name, Path(source))
            parts += parts_rows(name, "sim", out, args.sim_time_scale)
    print(f"the GPU's figures against the sim's medians over {args.rounds} rounds, GPU seconds:")
    print_table(rows, COLUMNS)
    verdicts = shapes(rows)
    for v in verdicts:
        print(
            f"{v['run']:5s} {v['column']:9s}: GPU {v['gpu']} by {v['gpu_margin']:.2f}x,"
            f" sim {v['sim']} by {v['sim_margin']:.2f}x -> {'same' if v['same'] else 'DIFFERS'}"
        )
    print("where the mean first token's time goes (medians of the runs' means), GPU seconds:")
    print_table(parts, PARTS_COLUMNS)
    if cpu:
        print("the device's workers' CPU per request: in the API servers (`thread`, `apart`) and")
        print("in the engine cores (`step`), medians:")
        for c in cpu:
            print(
                f"{c['run']:8s} {c['policy']:13s} API servers {c['server_cpu_ms']:6.1f} ms,"
                f" engine cores {c['core_cpu_ms']:6.1f} ms"
            )
    summary = {
        "args": args_dict(args),
        "gpu_sources": sources,
        "rows": [asdict(r) for r in rows],
        "shapes": verdicts,
        "first_token_parts": [asdict(p) for p in parts],
        "gpu_host_cpu": cpu,
    }
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
