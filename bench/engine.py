"""Engine benchmark: TTFT cold vs with a ~90% prefix hit, and decode throughput at batch 1 and 8.

    .venv/bin/python -m bench.engine --threads 1     # CPU demo model, float32
    .venv/bin/python -m bench.engine --device cuda --dtype bfloat16 --model /path/to/hf-model

Prints a table and writes bench/results/engine.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from pathlib import Path

from bench.report import write_json
from cachekey import Prompt
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "engine.json"


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Low ids are special tokens in most vocabularies (the demo's image placeholder among them).
    return [rng.randrange(100, vocab) for _ in range(n)]


def time_to_first_token(engine: LLMEngine, request_id: str, prompt: Prompt) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while True:
        outs = engine.step()
        if outs:
            elapsed = time.perf_counter() - start
            while engine.has_unfinished_requests():
                engine.step()
            return elapsed, outs[0].num_cached_tokens


def bench_ttft(engine: LLMEngine, prompt_len: int, hit: float, reps: int, vocab: int) -> dict:
    rng = random.Random(0)
    cold, warm, cached = [], [], []
    shared_len = int(prompt_len * hit)
    for rep in range(reps):
        base = random_tokens(rng, prompt_len, vocab)
        t, _ = time_to_first_token(engine, f"cold-{rep}", Prompt(tuple(base)))
        cold.append(t)
        follow = base[:shared_len] + random_tokens(rng, prompt_len - shared_len, vocab)
        t, n_cached = time_to_first_token(engine, f"warm-{rep}", Prompt(tuple(follow)))
        warm.append(t)
        cached.append(n_cached)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    return {
        "prompt_tokens": prompt_len,
        "cached_tokens": statistics.median(cached),
        "ttft_cold_s": cold_s,
        "ttft_hit_s": warm_s,
        "speedup": cold_s / warm_s,
    }


def decode_once(engine: LLMEngine, tag: str, batch: int, new_tokens: int, vocab: int) -> float:
    """Decode tokens/s of `batch` requests with 128-token prompts (prefill not counted)."""
    rng = random.Random(tag)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = Prompt(tuple(random_tokens(rng, 128, vocab)))
        engine.add_request(f"{tag}-{i}", prompt, params)
    produced = 0
    while produced < batch:  # prefill and every first token
        produced += len(engine.step())
    start = time.perf_counter()
    decoded = 0
    while engine.has_unfinished_requests():
        decoded += len(engine.step())
    return decoded / (time.perf_counter() - start)


def bench_decode(engine: LLMEngine, batch: int, new_tokens: int, reps: int, vocab: int) -> dict:
    decode_once(engine, f"warm-{batch}", batch, 8, vocab)  # first-call overheads of this shape
    rates = [decode_once(engine, f"dec-{batch}-{r}", batch, new_tokens, vocab) for r in range(reps)]
    return {"batch": batch, "new_tokens": new_tokens, "tokens_per_s": statistics.median(rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="model directory, or 'demo'")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--hit", type=float, default=0.9, help="shared prefix fraction")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is steadier on busy hosts)"
    )
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    model = args.model
    if model == "demo":
        from cachekey.demo import ensure_demo_model

        model = str(ensure_demo_model())
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device=args.device,
            dtype=args.dtype,
            num_blocks=(args.prompt_len * 2 + 8 * (128 + args.decode_tokens)) // 16 + 64,
            max_num_batched_tokens=max(2048, args.prompt_len),
        )
    )
    vocab = engine.runner.vocab_size
    rng = random.Random(42)
    for i in range(2):  # first-call overheads of the prefill shapes
        warm_prompt = Prompt(tuple(random_tokens(rng, args.prompt_len, vocab)))
        time_to_first_token(engine, f"warmup-{i}", warm_prompt)
    ttft = bench_ttft(engine, args.prompt_len, args.hit, args.reps, vocab)
    decode = [bench_decode(engine, b, args.decode_tokens, args.reps, vocab) for b in (1, 8)]
    result = {
        "model": args.model,
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "ttft": ttft,
        "decode": decode,
        "decode_batch8_over_batch1": decode[1]["tokens_per_s"] / decode[0]["tokens_per_s"],
    }
    print(f"engine bench: {result['model']} on {result['device']} ({result['dtype']})")
    print(f"{'metric':<38}{'value':>12}")
    cold_label = f"TTFT cold, {ttft['prompt_tokens']} tokens (ms)"
    print(f"{cold_label:<38}{ttft['ttft_cold_s'] * 1e3:>12.1f}")
    hit_label = f"TTFT with {ttft['cached_tokens']:.0f} cached tokens (ms)"
    print(f"{hit_label:<38}{ttft['ttft_hit_s'] * 1e3:>12.1f}")
    print(f"{'TTFT speedup (cold / hit)':<38}{ttft['speedup']:>12.2f}")
    for d in decode:
        print(f"{'decode tokens/s, batch ' + str(d['batch']):<38}{d['tokens_per_s']:>12.1f}")
    print(f"{'decode batch 8 / batch 1':<38}{result['decode_batch8_over_batch1']:>12.2f}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
