"""A decode step's wall time and GPU busy share, --async-scheduling off and on, in one run.

    python -m bench.decode_profile --device cuda --dtype bfloat16 --model llama-1b  # gpu.sh async
    python -m bench.decode_profile --threads 1        # the CPU: wall time per step only

Two engines on the same weights, one per mode, each with a fixed KV-cache budget. For each
scenario (decode at batch 1 and 64 over 128-token prompts, batch 16 over 2,048-token ones),
requests are prefilled, a few decode steps run unmeasured, then torch.profiler records `--steps`
steady decode steps: the wall time per step and, on CUDA, the kernels' time over the wall time
(GPU busy, as issue 35's profile counted it). Modes alternate in rotated order each round, so the
host's noise falls on both alike. Prints every round; writes JSON (--out).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.lib import engine_reference as ref
from bench.lib.engine_timing import resolve_model
from bench.lib.report import write_json
from cachekey import Prompt
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "decode_profile.json"
SCENARIOS = ((1, 128), (64, 128), (16, 2048))
MODES = ("sync", "async")


def build(args: argparse.Namespace, model: str, mode: str) -> LLMEngine:
    config = EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(b for b, _ in SCENARIOS),
        max_num_batched_tokens=4096,
        kv_cache_memory_bytes=args.kv_cache_gib << 30,
        async_scheduling=mode == "async",
    )
    return LLMEngine(config)


def measure(engine: LLMEngine, batch: int, plen: int, steps: int, tag: str) -> dict:
    """Wall ms per steady decode step and the device's busy share of it (None on the CPU)."""
    device = torch.device(engine.config.device)
    rng = random.Random(tag)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    vocab = engine.runner.vocab_size
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", Prompt(tuple(ref.random_ids(rng, plen, vocab))), params)
    produced = 0
    while produced < batch:  # prefill and every first token
        produced += len(engine.step())
    for _ in range(4):  # steady decode: with async scheduling, a step is in flight from here
        engine.step()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    ref.synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        ref.synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    busy = None
    if device.type == "cuda":
        kernels_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
        busy = kernels_ms / wall_ms
    return {"ms_per_step": wall_ms / steps, "gpu_busy": busy}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="directory, 'demo', or a shape name")
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/kvgate-bench-models"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-gib", type=int, default=None, help="per engine (default 8; CPU 1)")
    p.add_argument("--steps", type=int, default=20, help="profiled decode steps per scenario")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p


def main() -> None:
    args = _parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kv_cache_gib is None:
        args.kv_cache_gib = 8 if args.device == "cuda" else 1
    model, _ = resolve_model(args.model, args.models_dir, torch.device(args.device))
    engines = {mode: build(args, model, mode) for mode in MODES}
    for mode, engine in engines.items():  # first-call costs, and the profiler's own
        measure(engine, 2, 128, 4, f"warm-{mode}")
    rows = []
    for r in range(args.rounds):
        for i in range(len(MODES)):
            mode = MODES[(r + i) % len(MODES)]
            for batch, plen in SCENARIOS:
                got = measure(engines[mode], batch, plen, args.steps, f"{mode}-{r}-{batch}-{plen}")
                rows.append({"round": r, "mode": mode, "batch": batch, "context": plen, **got})
                busy = "-" if got["gpu_busy"] is None else f"{got['gpu_busy']:.0%}"
                print(
                    f"round {r} {mode:<5} batch {batch:>2} ctx {plen:>4}: "
                    f"{got['ms_per_step']:7.2f} ms/step, GPU busy {busy}",
                    flush=True,
                )
    write_json(args.out, {"model": args.model, "device": args.device, "rows": rows})


if __name__ == "__main__":
    main()
