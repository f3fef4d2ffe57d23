"""Timing the engine in-process: a clock that waits for the device, time to first token, decode
tokens/s, and the model a benchmark names (a directory, `demo`, or a random-weight shape)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from bench.lib import engine_reference as ref
from cachekey import Prompt
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams


class Clock:
    def __init__(self, kind: str, device: torch.device) -> None:
        self.now = time.process_time if kind == "cpu" else time.perf_counter
        self.device = device

    def __call__(self) -> float:
        ref.synchronize(self.device)
        return self.now()


def time_to_first_token(engine: LLMEngine, clock: Clock, rid: str, ids: list[int]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = clock()
    engine.add_request(rid, Prompt(tuple(ids)), params)
    while not engine.step():
        pass
    elapsed = clock() - start
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def decode_rate(
    engine: LLMEngine,
    clock: Clock,
    tag: str,
    batch: int,
    plen: int,
    new: int,
    vocab: int,
    own: int | None = None,
) -> float:
    """Decode tokens/s of `batch` requests with plen-token prompts (prefill not counted). With
    `own`, the prompts share all but their last `own` tokens (a tenant's system prompt)."""
    rng = random.Random(tag)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    common = ref.random_ids(rng, plen - own, vocab) if own is not None else []
    for i in range(batch):
        ids = [*common, *ref.random_ids(rng, plen - len(common), vocab)]
        engine.add_request(f"{tag}-{i}", Prompt(tuple(ids)), params)
    produced = 0
    while produced < batch:  # prefill and every first token
        produced += len(engine.step())
    start = clock()
    decoded = 0
    while engine.has_unfinished_requests():
        decoded += len(engine.step())
    return decoded / (clock() - start)


def resolve_model(name: str, models_dir: Path, device: torch.device) -> tuple[str, int | None]:
    """(model directory, parameter count when generated here)."""
    from harness.random_llama import SHAPES, write_random_llama

    if name == "demo":
        from worker.demo.model import ensure_demo_model

        return str(ensure_demo_model()), None
    if name in SHAPES:
        path = models_dir / name
        print(f"model: random-weight {name} in {path}", flush=True)
        return str(path), write_random_llama(path, name, device.type)
    return name, None
