"""The host KV tier: TTFT of a host-tier hit against a cold prefill and a GPU-tier hit.

    .venv/bin/python -m bench.host_tier          # CPU: table + bench/results/host_tier.json
    python -m bench.host_tier --device cuda --dtype bfloat16 --model llama-1b --tokens 8000 \
        --num-blocks 1200 --kv-offload-blocks 2400     # on a GPU (bash bench/gpu.sh hosttier)

One torch engine (the demo model in float32 by default; `--model` also takes a random-weight
shape, as bench.engine's does), the host tier on (`--kv-offload-blocks`). Each round takes
a fresh `--tokens`-token prompt P and times its first token three ways: **cold** (P's first
time), **gpu hit** (P again while its blocks are in the device pool) and **host hit** (P after
filler prompts pushed every one of its blocks out of the pool into the host tier: they are
copied back, not recomputed). Even rounds time the GPU hit first, odd rounds the host hit first
(then the GPU hit follows the copy back), so the order is rotated; round 0 warms up and is not
summarised. Each hit's cached tokens are checked. The clock is process CPU time by default
(`--clock wall` for the wall clock), on one torch thread unless `--threads`.
On the CPU "device" and host memory are the same memory: the copy back is a memcpy, and the
figure says what the bookkeeping and the copies cost against a prefill, not what a GPU's
host-to-device link costs. On CUDA the clock is the wall clock after a device synchronize.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

import torch

from bench.lib import engine_reference as ref
from bench.lib.engine_timing import Clock, resolve_model, time_to_first_token
from bench.lib.report import args_dict, write_json
from cachekey import block_keys
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine

RESULTS = Path(__file__).resolve().parent / "results" / "host_tier.json"


def evict(engine: LLMEngine, ids: list[int], rng: random.Random, clock: Clock, tag: str) -> int:
    """Filler prompts until none of `ids`' blocks is left in the device pool; how many."""
    keys = block_keys(ids, engine.namespace)
    n = 0
    while any(engine.block_manager.pool.lookup(k) for k in keys):
        time_to_first_token(engine, clock, f"{tag}-fill{n}", ref.random_ids(rng, len(ids), 2000))
        n += 1
    return n


def cached(engine: LLMEngine) -> tuple[int, int]:
    counters = engine.scheduler.counters
    return counters.prefix_hits_tokens, counters.host_hits_tokens


def one_round(engine: LLMEngine, clock: Clock, rnd: int, n: int) -> dict:
    rng = random.Random(rnd)
    ids = ref.random_ids(rng, n, 2000)
    full = (n - 1) // 16 * 16
    row = {"round": rnd, "cold_ms": time_to_first_token(engine, clock, f"c{rnd}", ids) * 1e3}

    def hit(kind: str, seq: int) -> None:
        before = cached(engine)
        row[f"{kind}_hit_ms"] = time_to_first_token(engine, clock, f"{kind}{rnd}.{seq}", ids) * 1e3
        gpu, host = (a - b for a, b in zip(cached(engine), before, strict=True))
        want = (full, 0) if kind == "gpu" else (0, full)
        # Counters count a request's first admission only: each timed request is a new one.
        assert (gpu, host) == want, (kind, gpu, host)

    if rnd % 2 == 0:
        hit("gpu", 0)
        row["fillers"] = evict(engine, ids, rng, clock, f"e{rnd}")
        hit("host", 1)
    else:
        row["fillers"] = evict(engine, ids, rng, clock, f"e{rnd}")
        hit("host", 0)
        hit("gpu", 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7, help="round 0 warms up")
    ap.add_argument("--num-blocks", type=int, default=300, help="the device pool")
    ap.add_argument("--kv-offload-blocks", type=int, default=1024)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="demo", help="directory, 'demo', or a shape name")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/kvgate-bench-models"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type != "cpu" and args.clock == "cpu":
        args.clock = "wall"  # process CPU time says nothing of a device's work
    torch.set_num_threads(args.threads)
    model, _ = resolve_model(args.model, args.models_dir, device)
    config = EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        num_blocks=args.num_blocks,
        kv_offload_blocks=args.kv_offload_blocks,
        max_num_batched_tokens=max(2048, args.tokens + 1),
    )
    engine = LLMEngine(config)
    clock = Clock(args.clock, device)
    rows = []
    print(f"{'round':>5} {'cold ms':>9} {'gpu hit ms':>11} {'host hit ms':>12} {'fillers':>8}")
    for rnd in range(args.rounds):
        row = one_round(engine, clock, rnd, args.tokens)
        rows.append(row)
        cells = (row["cold_ms"], row["gpu_hit_ms"], row["host_hit_ms"])
        print(f"{rnd:>5} {cells[0]:9.2f} {cells[1]:11.2f} {cells[2]:12.2f} {row['fillers']:>8}")
    measured = rows[1:] or rows
    summary = {k: statistics.median(r[k] for r in measured) for k in rows[0] if k.endswith("ms")}
    summary["host_over_cold"] = summary["host_hit_ms"] / summary["cold_ms"]
    summary["host_over_gpu"] = summary["host_hit_ms"] / summary["gpu_hit_ms"]
    print("median of rounds 1..: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    write_json(args.out, {"args": args_dict(args), "rounds": rows, "summary": summary})


if __name__ == "__main__":
    main()
