"""Hidden-state prefix caching on the CPU demo model: prefill with and without caching, and what
the hidden-state cache costs requests that do not want hidden states.

    .venv/bin/python -m bench.hidden_prefill        # tables + bench/results/hidden_prefill.json

Part 1: 20 prompts of ~2,000 tokens whose first 90% are shared, as mean-pooled embedding requests
(the hard case: every prompt token's final hidden state is read), once as text and once with four
images in the shared part. `cached`: prefix caching + `--hidden-state-cache`; `uncached`: no
prefix caching (the hidden-state cache still on, to read the states of the computed tokens). The
prompts alternate between the engines, so all see the same host load; each round starts from
empty caches. Reported: all 20 prompts from a cold cache, the 19 that follow the first, and the
largest difference between the two engines' embeddings. `kv only` runs the same prompts as plain
one-token completions on an engine with prefix caching and no hidden-state cache: the speedup the
prefix cache gives a request that wants no hidden states, for comparison.

Part 2: plain generation (no request wants hidden states) on engines with the hidden-state cache
off and on: a 2,000-token cold prefill and 64 decode steps at batch 8, alternated the same way.

Times are process CPU time by default (`--clock wall` for the wall clock): on a shared host it
moves far less than the wall clock. One torch thread unless `--threads`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from bench.lib.report import args_dict, col, columns, print_table, write_json
from cachekey import Prompt
from harness.prefill_prompts import image_prompts, text_prompts
from worker.demo.model import ensure_demo_model
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "hidden_prefill.json"
EMBED = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@dataclass(slots=True)
class PrefillRow:
    workload: str = col("workload", 9, left=True)
    prompts: int
    mean_tokens: int = col("tokens", 7)
    hit_rate: float = col("hit", 7, ".1%")  # of the cached engine, all prompts
    cached_all_ms: float = col("cached 20", 11, ".0f", "ms")  # the 20 prompts, from a cold cache
    uncached_all_ms: float = col("uncached 20", 13, ".0f", "ms")
    speedup_all: float = col("x", 7, ".1f")
    # the 19 prompts after the first, per prompt
    cached_after_first_ms: float = col("cached/p", 10, ".1f", "ms")
    # the same prompts, no hidden states, prefix caching on
    kv_only_after_first_ms: float = col("kv only/p", 11, ".1f", "ms")
    uncached_after_first_ms: float = col("uncached/p", 12, ".1f", "ms")
    speedup_after_first: float = col("x", 7, ".1f")
    # largest |cached - uncached| over every embedding value
    max_abs_diff: float = col("max diff", 10, ".1e")


PREFILL_COLS = columns(PrefillRow)


@dataclass(slots=True)
class OverheadRow:
    figure: str = col("no request wants hidden states", 36, left=True)
    cache_off_ms: float = col("cache off", 11, ".2f", "ms")
    cache_on_ms: float = col("cache on", 11, ".2f", "ms")
    on_over_off: float = col("on/off", 8, ".3f")


OVERHEAD_COLS = columns(OverheadRow)


def make_engine(model: str, **overrides: object) -> LLMEngine:
    config = {"device": "cpu", "dtype": "float32", "block_size": 16, **overrides}
    return LLMEngine(EngineConfig(model=model, **config))  # type: ignore[arg-type]


def run(engine: LLMEngine, rid: str, prompt: Prompt, clock: Callable[[], float], **kw):
    """(seconds, final output) of one request run alone."""
    start = clock()
    engine.add_request(rid, prompt, kw.pop("params", EMBED), **kw)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                final = out
    return clock() - start, final


def prefill_round(
    model: str, prompts: list[Prompt], clock
) -> tuple[list, list, list, float, float]:
    cached = make_engine(model, hidden_state_cache=True)
    uncached = make_engine(model, hidden_state_cache=True, enable_prefix_caching=False)
    kv_only = make_engine(model)
    hot_t, cold_t, kv_t, diff, hits = [], [], [], 0.0, 0
    for i, prompt in enumerate(prompts):
        t_hot, hot = run(cached, f"c{i}", prompt, clock, hidden_states="mean")
        t_cold, cold = run(uncached, f"u{i}", prompt, clock, hidden_states="mean")
        kv_t.append(run(kv_only, f"k{i}", prompt, clock)[0])
        hot_t.append(t_hot)
        cold_t.append(t_cold)
        hits += hot.num_cached_tokens
        diff = max(diff, float(np.abs(hot.hidden_states - cold.hidden_states).max()))
    return hot_t, cold_t, kv_t, diff, hits / sum(len(p) for p in prompts)


def prefill_row(name: str, model: str, prompts: list[Prompt], rounds: int, clock) -> PrefillRow:
    totals: dict[str, list[float]] = {k: [] for k in ("ca", "ua", "cf", "uf", "kf")}
    diff = hit = 0.0
    for _ in range(rounds):
        hot, cold, kv, d, hit = prefill_round(model, prompts, clock)
        totals["kf"].append(statistics.mean(kv[1:]))
        diff = max(diff, d)
        totals["ca"].append(sum(hot))
        totals["ua"].append(sum(cold))
        totals["cf"].append(statistics.mean(hot[1:]))
        totals["uf"].append(statistics.mean(cold[1:]))
    med = {k: statistics.median(v) * 1000 for k, v in totals.items()}
    return PrefillRow(
        workload=name,
        prompts=len(prompts),
        mean_tokens=round(statistics.mean(len(p) for p in prompts)),
        hit_rate=hit,
        cached_all_ms=med["ca"],
        uncached_all_ms=med["ua"],
        speedup_all=med["ua"] / med["ca"],
        cached_after_first_ms=med["cf"],
        kv_only_after_first_ms=med["kf"],
        uncached_after_first_ms=med["uf"],
        speedup_after_first=med["uf"] / med["cf"],
        max_abs_diff=diff,
    )


def overhead_rows(model: str, rounds: int, clock) -> list[OverheadRow]:
    """The common path: generation requests on engines with the hidden-state cache off and on."""
    engines = {on: make_engine(model, hidden_state_cache=on) for on in (False, True)}
    rng = random.Random(1)
    prefill: dict[bool, list[float]] = {False: [], True: []}
    decode: dict[bool, list[float]] = {False: [], True: []}
    gen = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
    for r in range(rounds * 4):
        prompt = text_prompts(1, 2000, 0.0, rng)[0]
        batch = text_prompts(8, 128, 0.0, rng)
        for on in (False, True) if r % 2 else (True, False):  # neither always goes first
            engine = engines[on]
            t, _ = run(engine, f"p{r}", prompt, clock)  # unique: a cold 2,000-token prefill
            prefill[on].append(t)
            for i, p in enumerate(batch):
                engine.add_request(f"d{r}-{i}", p, gen)
            engine.step()  # the prefills; then 64 steps of pure decode
            start = clock()
            while engine.has_unfinished_requests():
                engine.step()
            decode[on].append((clock() - start) / 64)
    rows = []
    for name, samples in (("prefill, 2,000 tokens", prefill), ("decode step, batch 8", decode)):
        off, on = (statistics.median(samples[k]) * 1000 for k in (False, True))
        rows.append(OverheadRow(name, off, on, on / off))
    return rows


def write_cost_ms(engine: LLMEngine, tokens: int, clock, repeats: int = 2000) -> float:
    """What the cache adds to one step of `tokens` tokens: its hook's work (find the slot
    mapping, copy the output rows), timed alone since it is far below the steps' noise."""
    cache = engine.runner.hidden_cache
    assert cache is not None
    hook = cache._post_hook(len(cache.layers))
    args = (SimpleNamespace(slot_mapping=torch.arange(tokens)),)
    output = torch.randn(tokens, cache.cache.shape[2], dtype=cache.cache.dtype)
    start = clock()
    for _ in range(repeats):
        hook(None, args, {}, output)
    return (clock() - start) / repeats * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--shared", type=float, default=0.9)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model = str(ensure_demo_model()) if args.model == "demo" else args.model
    rng = random.Random(args.seed)
    renderer = make_engine(model, num_blocks=16).renderer
    workloads = {
        "text": text_prompts(args.prompts, args.tokens, args.shared, rng),
        "images": image_prompts(renderer, args.prompts, args.tokens, args.shared, rng),
    }
    rows = []
    print_table([], PREFILL_COLS)
    for name, prompts in workloads.items():
        rows.append(prefill_row(name, model, prompts, args.rounds, clock))
        print_table(rows[-1:], PREFILL_COLS, header=False)
    print()
    overhead = overhead_rows(model, args.rounds, clock)
    print_table(overhead, OVERHEAD_COLS)
    engine = make_engine(model, hidden_state_cache=True, num_blocks=512)
    writes = {"decode_batch_8_ms": write_cost_ms(engine, 8, clock)}
    writes["prefill_2000_ms"] = write_cost_ms(engine, 2000, clock, repeats=200)
    print(
        f"hidden-state write per step, timed alone: {writes['decode_batch_8_ms'] * 1000:.1f} us "
        f"at batch 8 ({writes['decode_batch_8_ms'] / overhead[1].cache_off_ms:.2%} of a decode "
        f"step), {writes['prefill_2000_ms'] * 1000:.0f} us for 2,000 tokens "
        f"({writes['prefill_2000_ms'] / overhead[0].cache_off_ms:.2%} of that prefill)"
    )
    write_json(
        args.out,
        {
            "args": args_dict(args),
            "prefill": [asdict(r) for r in rows],
            "overhead": [asdict(r) for r in overhead],
            "write_cost": writes,
        },
    )


if __name__ == "__main__":
    main()
