"""Eviction and preemption under KV-cache pressure: outputs stay exact, events stay exact."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cachekey import Prompt
from cachekey.events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.support.engine import generate, image_chat, make_engine, png_bytes, run_all, tokens
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

BS = 16


class EventReplica:
    """What a gateway learns from the events alone: the set of cached keys."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.num_removed = 0

    def apply(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                assert ev.block_size == BS
                assert len(ev.token_ids) == BS * len(ev.block_hashes)
                assert ev.extra_keys is not None and len(ev.extra_keys) == len(ev.block_hashes)
                assert not self.keys & set(ev.block_hashes), "stored twice without removal"
                self.keys |= set(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= self.keys, "removed a block never stored"
                self.keys -= set(ev.block_hashes)
                self.num_removed += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.keys.clear()


def random_prompts(engine: LLMEngine, rng: random.Random, n: int) -> list[Prompt]:
    stems = [
        engine.renderer.render_completion(f"System prompt {i}: " + "be kind. " * 12)
        for i in range(3)
    ]
    images = [png_bytes(s) for s in (11, 12)]
    prompts = []
    for _ in range(n):
        if rng.random() < 0.25:
            prompts.append(
                image_chat(engine, "Q", rng.choice(images), "word " * rng.randrange(1, 30))
            )
            continue
        stem = list(rng.choice(stems).token_ids)
        tail = [rng.randrange(10, 1900) for _ in range(rng.randrange(1, 40))]
        prompts.append(Prompt(tuple(stem[: rng.randrange(8, len(stem) + 1)] + tail)))
    return prompts


def test_randomized_eviction_outputs_and_event_replay(demo_model_dir: Path) -> None:
    rng = random.Random(1234)
    engine = make_engine(demo_model_dir, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=96)
    reference = make_engine(demo_model_dir, enable_prefix_caching=False)
    prompts = random_prompts(engine, rng, 24)
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 9), ignore_eos=True)
        for _ in prompts
    ]
    replica = EventReplica()
    outputs: dict[str, list] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(f"r{i}", p, params[i])
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        replica.apply(engine.drain_events())
        held = {b.key for b in engine.snapshot_blocks()}
        assert replica.keys == held == set(engine.block_manager.pool.cached)
        steps += 1
        assert steps < 5000
    assert engine.stats().prefix_hits_tokens > 0
    assert replica.num_removed > 20  # the cache really was under pressure
    for i, p in enumerate(prompts):
        ref = generate(reference, f"ref{i}", p, params[i])
        assert tokens(outputs[f"r{i}"]) == tokens(ref), f"request {i} diverged"


def test_more_requests_than_cache_all_complete(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir, num_blocks=10, max_num_seqs=8)
    prompts = [
        engine.renderer.render_completion(f"Request {i} says " + "hello " * (8 + 3 * i))
        for i in range(6)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", p, params)
    together = run_all(engine)
    assert engine.scheduler.counters.num_preemptions > 0
    assert engine.block_manager.pool.num_free == engine.block_manager.num_blocks
    alone = make_engine(demo_model_dir, num_blocks=64, enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        assert tokens(together[f"c{i}"]) == tokens(generate(alone, f"a{i}", p, params))
        assert together[f"c{i}"][-1].num_output_tokens == 24


def test_prompt_larger_than_cache_is_rejected(demo_model_dir: Path) -> None:
    from cachekey.errors import PromptTooLongError

    engine = make_engine(demo_model_dir, num_blocks=2)
    with pytest.raises(PromptTooLongError, match="KV cache"):
        engine.add_request("big", Prompt(tuple(range(10, 50))), SamplingParams())
    assert not engine.has_unfinished_requests()
    # A prompt that fits generates until the cache is full, then stops with "length".
    engine.add_request(
        "ok", Prompt(tuple(range(10, 20))), SamplingParams(max_tokens=100, ignore_eos=True)
    )
    out = run_all(engine)["ok"]
    assert out[-1].finish_reason == "length" and out[-1].num_output_tokens == 32 - 10
