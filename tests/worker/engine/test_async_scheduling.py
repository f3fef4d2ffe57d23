"""--async-scheduling against the synchronous engine on the same requests: the same outputs
(tokens, text, finish reasons, usage), the same KV events in the same order, the same counters.
Greedy and seeded sampling, stop tokens and strings, max_tokens, images, cache_salt, LoRA,
requests arriving while others decode, preemption and eviction under a small KV pool; aborts on
what a request streamed (the same streams). Each run also proves that steps really were launched
ahead (`AsyncSteps.chained`) and rows thrown away. Steps that carry prompt chunks and admissions:
tests/worker/engine/test_async_mixed_steps.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cachekey import HashNamespace, Prompt
from cachekey.events import BlockRemoved
from tests.support.async_runs import Req, add_stops, compare, drive, mixed_requests
from tests.support.engine import make_engine
from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence


# Roomy, then evicting and preempting, then with the hidden-state cache (written like the K/V).
@pytest.mark.parametrize(("num_blocks", "hidden"), [(256, False), (14, False), (40, True)])
def test_outputs_and_events_equal_the_synchronous_engine(
    demo_model_dir: Path, num_blocks: int, hidden: bool
) -> None:
    config = {"num_blocks": num_blocks, "max_num_seqs": 6, "max_num_batched_tokens": 96}
    config["hidden_state_cache"] = hidden
    engine = make_engine(demo_model_dir, **config)
    reqs = mixed_requests(engine, random.Random(7), 14)
    add_stops(reqs, drive(engine, reqs))
    run, async_engine = compare(demo_model_dir, reqs, **config)
    reasons = {o[2] for outs in run.outputs.values() for o in outs if len(o) > 1}
    assert {"stop", "length"} <= reasons
    assert sum(len(outs) for outs in run.outputs.values()) > 100
    assert async_engine.block_manager.pool.num_free == num_blocks
    if num_blocks == 14:  # the cache was under pressure: preemptions, evictions
        assert run.counters[4] > 0
        assert any(isinstance(e, BlockRemoved) for e in run.events)


def test_requests_arriving_mid_stream(demo_model_dir: Path) -> None:
    """Arrivals while others decode are scheduled at the step the synchronous engine schedules
    them: the whole runs are equal, steps carrying prompts were launched ahead, and one with an
    image's rows ran synchronously after the step in flight was read back."""
    config = {"num_blocks": 64, "max_num_seqs": 4}
    engine = make_engine(demo_model_dir, **config)
    reqs = mixed_requests(engine, random.Random(3), 8)
    for i, r in enumerate(reqs):
        r.arrive_at = 3 * i
    add_stops(reqs, drive(engine, reqs))
    _, async_engine = compare(demo_model_dir, reqs, **config)
    steps = async_engine._async
    assert steps is not None and steps.chained_mixed > 0
    assert steps.refused["unlaunchable"] > 0  # an image arrived while a step was in flight


def test_aborts_on_what_was_streamed(demo_model_dir: Path) -> None:
    """An abort the client sends on a token reaches the engine one step later (that token was
    read back while the next step ran): the streams are the same, the pool ends empty."""
    config = {"num_blocks": 40, "max_num_seqs": 4, "max_num_batched_tokens": 64}
    engine = make_engine(demo_model_dir, **config)
    reqs = mixed_requests(engine, random.Random(11), 10)
    for i, r in enumerate(reqs):
        r.arrive_at = 2 * i
    add_stops(reqs, drive(engine, reqs))
    for r, after in zip(reqs[1::3], (1, 2, 4), strict=False):
        r.abort_after = after
    run, async_engine = compare(demo_model_dir, reqs, exact=False, **config)
    assert sum(outs[-1] == ("abort",) for outs in run.outputs.values()) == 3
    assert async_engine.block_manager.pool.num_free == 40


def test_lora_adapters(demo_model_dir: Path, tmp_path: Path) -> None:
    # Imported here: peft is a test dependency the GPU machine lacks (bench/gpu.sh async).
    from tests.support.lora_fixtures import ALL_PROJECTIONS, write_peft_adapter, write_tiny_llama

    base = write_tiny_llama(tmp_path / "base", demo_model_dir)
    adapters = {
        name: write_peft_adapter(base, tmp_path / name, seed, r=4, target_modules=ALL_PROJECTIONS)
        for name, seed in (("alpha", 1), ("beta", 2))
    }
    modules = tuple(f"{name}={path}" for name, path in adapters.items())
    rng = random.Random(5)
    reqs = [
        Req(
            f"l{i}",
            Prompt(tuple(rng.randrange(50, 1900) for _ in range(rng.randrange(5, 40)))),
            SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 20), ignore_eos=True),
            lora=(None, "alpha", "beta")[i % 3],
        )
        for i in range(9)
    ]
    compare(base, reqs, lora_modules=modules, max_loras=1, max_num_seqs=4)


def test_sim_engine_steps_synchronously(demo_model_dir: Path) -> None:
    config = EngineConfig(model=str(demo_model_dir), engine="sim", async_scheduling=True)
    assert LLMEngine(config)._async is None  # nothing to overlap: the option is a no-op


def test_a_block_taken_for_a_discarded_token_goes_back_to_the_head() -> None:
    """The free queue after a request stops is the synchronous engine's, block for block."""
    ns = HashNamespace("unit-model", block_size=4)

    def stopped(launched_ahead: bool) -> list[int]:
        bm = BlockManager(8, 4, True, "partial")
        seq = Sequence("a", Prompt(tuple(range(1, 8))), SamplingParams(), ns)
        bm.allocate(seq, [], 7)  # the prompt's 7 tokens: two blocks
        seq.num_computed_tokens = 7
        bm.cache_full_blocks(seq)
        seq.append_token(50, ns)  # its first token; step N computes it at position 7
        bm.append_slots(seq, 1)
        seq.num_computed_tokens = 8
        if launched_ahead:  # step N+1 scheduled before step N's token is known
            seq.num_pending_tokens = 1
            assert bm.blocks_needed(seq, 1) == 1 and bm.pool.takes_no_cached(1)
            bm.append_slots(seq, 1)
        seq.append_token(51, ns)  # step N's token: a stop token, the request ends
        bm.free(seq)
        return [b.block_id for b in bm.pool.free_queue]

    assert stopped(True) == stopped(False)
