"""Engine benchmark: TTFT cold and with a ~90% prefix hit, decode tokens/s; CPU and GPU.

    .venv/bin/python -m bench.engine --threads 1          # CPU suite: demo model, float32
    python -m bench.engine --device cuda --dtype bfloat16 --model llama-1b   # GPU suite

The CPU suite: TTFT at 2,048 tokens, decode at batch 1 and 8 (128-token prompts) and at batch 16
over 2,048-token prompts that share all but their last 16 tokens. The GPU suite
(the default on CUDA) has the scenarios of the issue: TTFT cold and with a 90% prefix hit at 2,048
and 8,000 tokens; decode at batch 1/8/32/64 with 128-token prompts and batch 16 at 2,048 tokens of
context; then transformers on the same weights, and the device's floors, in the same run.
`--suite gpu-decode` is the GPU suite's TTFT at 2,048 tokens and decode at batch 1, 64 and 16 at
2,048 tokens (what `bench/gpu.sh async` compares with --async-scheduling off and on).
`--long N` adds one N-token prompt on an engine with default memory settings (it must finish).
`--model` is a directory, `demo`, or a shape (llama-1b, llama-3b, llama-8b) written once with
random weights under --models-dir. `--clock cpu` times with process CPU time instead of the wall
clock (CPU only: steadier on a shared host). Prints each figure as it is measured; writes JSON.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from bench.lib import engine_reference as ref
from bench.lib.engine_timing import Clock, decode_rate, resolve_model, time_to_first_token
from bench.lib.report import write_json
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine

RESULTS = Path(__file__).resolve().parent / "results" / "engine.json"
SUITES = {
    # shared: batch 16 whose 2,048-token prompts share all but their last 16 tokens.
    "cpu": {"prompt_lens": [2048], "decode": [(1, 128), (8, 128)], "shared": [(16, 2048)]},
    "gpu": {
        "prompt_lens": [2048, 8000],
        "decode": [(1, 128), (8, 128), (32, 128), (64, 128), (16, 2048)],
    },
    # The decode figures --async-scheduling is for (bench/gpu.sh async).
    "gpu-decode": {"prompt_lens": [2048], "decode": [(1, 128), (64, 128), (16, 2048)]},
}


def bench_ttft(engine: LLMEngine, clock: Clock, n: int, hit: float, reps: int, vocab: int) -> dict:
    rng = random.Random(n)
    shared = int(n * hit)
    cold, warm = [], []
    for rep in range(reps):
        base = ref.random_ids(rng, n, vocab)
        cold.append(time_to_first_token(engine, clock, f"cold-{n}-{rep}", base))
        follow = base[:shared] + ref.random_ids(rng, n - shared, vocab)
        warm.append(time_to_first_token(engine, clock, f"warm-{n}-{rep}", follow))
    return {"cold_ms": statistics.median(cold) * 1e3, "hit_ms": statistics.median(warm) * 1e3}


def engine_figures(args: argparse.Namespace, model: str, suite: dict, report: Callable) -> int:
    device = torch.device(args.device)
    longest = max(suite["prompt_lens"])
    # Only fields every engine version has, unless asked: the CPU A/B runs this file on old code.
    extra: dict = {"enforce_eager": True} if args.enforce_eager else {}
    if args.elementwise_kernels:
        extra["elementwise_kernels"] = args.elementwise_kernels
    if args.async_scheduling:
        extra["async_scheduling"] = True
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device=args.device,
            dtype=args.dtype,
            num_blocks=args.num_blocks,
            max_num_seqs=max(b for b, _ in suite["decode"] + suite.get("shared", [])),
            max_num_batched_tokens=args.max_num_batched_tokens or max(2048, longest),
            **extra,
        )
    )
    runner = engine.runner
    report("engine_num_blocks", runner.num_blocks)
    attention = getattr(runner, "decode_attention", "-")
    elementwise = getattr(runner.model, "elementwise", "-")
    graphs = getattr(runner, "use_cuda_graphs", "-")
    print(f"decode attention: {attention}; elementwise: {elementwise}; cuda graphs: {graphs}")
    clock = Clock(args.clock, device)
    vocab = runner.vocab_size
    rng = random.Random(42)
    for i in range(2):  # first-call costs of the prefill shapes
        time_to_first_token(engine, clock, f"warmup-{i}", ref.random_ids(rng, longest, vocab))
    for n in suite["prompt_lens"]:
        ttft = bench_ttft(engine, clock, n, args.hit, args.reps, vocab)
        report(f"engine_ttft_cold_{n}_ms", ttft["cold_ms"])
        report(f"engine_ttft_hit{round(args.hit * 100)}_{n}_ms", ttft["hit_ms"])
    for batch, plen in suite["decode"]:
        decode_rate(engine, clock, f"warm-{batch}-{plen}", batch, plen, 8, vocab)
        rates = [
            decode_rate(engine, clock, f"d-{batch}-{plen}-{r}", batch, plen, args.new_tokens, vocab)
            for r in range(args.reps)
        ]
        report(f"engine_decode_b{batch}_ctx{plen}_tok_s", statistics.median(rates))
    for batch, plen in suite.get("shared", []):
        rates = [
            decode_rate(engine, clock, f"s-{r}", batch, plen, args.new_tokens, vocab, own=16)
            for r in range(args.reps)
        ]
        report(f"engine_decode_b{batch}_shared{plen}_tok_s", statistics.median(rates))
    params = sum(p.numel() for p in runner.model.parameters())
    del engine, runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return params


def long_prompt(args: argparse.Namespace, model: str, report: Callable) -> None:
    """One args.long-token prompt on an engine with every memory setting at its default."""
    engine = LLMEngine(EngineConfig(model=model, device=args.device, dtype=args.dtype))
    report("long_engine_num_blocks", engine.runner.num_blocks)
    clock = Clock("wall", torch.device(args.device))
    ids = ref.random_ids(random.Random(7), args.long, engine.runner.vocab_size)
    report(f"long_ttft_{args.long}_ms", time_to_first_token(engine, clock, "long", ids) * 1e3)
    if args.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        report("long_gpu_used_gib", (total - free) / 2**30)
        report("long_gpu_total_gib", total / 2**30)
    del engine


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="directory, 'demo', or a shape name")
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/kvgate-bench-models"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--suite", choices=sorted(SUITES), default=None, help="default: by device")
    parser.add_argument("--hit", type=float, default=0.9, help="shared prefix fraction")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=None, help="default: from memory")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--elementwise-kernels",
        choices=("auto", "reference", "triton"),
        default=None,
        help="fused norm/rotary/SwiGLU kernels or the torch reference (default: the engine's)",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="the engine's --async-scheduling (each decode step launched while the last runs)",
    )
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also the floors and transformers on the same weights (default: GPU suite only)",
    )
    parser.add_argument("--long", type=int, default=0, help="also one prompt of this length")
    parser.add_argument("--only-long", action="store_true", help="only the --long prompt")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def _result_head(args: argparse.Namespace, device: torch.device) -> dict:
    return {
        "model": args.model,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "clock": args.clock,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "figures": {},
    }


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: decode is timed from the first new token")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.clock == "cpu" and device.type != "cpu":
        parser.error("--clock cpu measures host CPU time: only for --device cpu")
    suite = SUITES[args.suite or ("gpu" if device.type == "cuda" else "cpu")]
    if args.num_blocks is None and device.type == "cpu":
        longest = max(suite["prompt_lens"])
        args.num_blocks = (2 * longest + 8 * (128 + args.new_tokens)) // 16 + 64
    dtype = getattr(torch, args.dtype)
    result = _result_head(args, device)

    def report(name: str, value: float) -> None:
        result["figures"][name] = value
        print(f"{name:<40}{value:>14.1f}", flush=True)

    model, params = resolve_model(args.model, args.models_dir, device)
    print(f"engine bench: {args.model} on {result['device']} ({args.dtype})", flush=True)
    if not args.only_long:
        params = engine_figures(args, model, suite, report) or params
    if params:
        report("params", params)
    if args.long:
        long_prompt(args, model, report)
    if args.compare is False or (args.compare is None and suite is not SUITES["gpu"]):
        write_json(args.out, result)
        return
    for name, value in ref.floors(device, dtype, params, min(suite["prompt_lens"])).items():
        report(f"floor_{name}", value)
    try:
        import transformers

        result["transformers"] = transformers.__version__
        ref.transformers_figures(
            Path(model),
            device,
            dtype,
            suite["prompt_lens"],
            suite["decode"],
            args.new_tokens,
            args.reps,
            report,
        )
    except Exception as exc:  # keep the engine's figures when transformers fails
        result["hf_error"] = repr(exc)
        print(f"transformers failed: {exc!r}", flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
