"""--async-scheduling against the synchronous engine on the same requests: the same outputs
(tokens, text, finish reasons, usage), the same KV events in the same order, the same counters.
Greedy and seeded sampling, stop tokens and strings, max_tokens, aborts mid-stream, images,
cache_salt, LoRA, preemption and eviction under a small KV pool. Each run also proves that
steps really were launched ahead (`AsyncSteps.chained`) and rows thrown away."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cachekey import HashNamespace, Prompt
from cachekey.events import BlockRemoved
from tests.support.engine import image_chat, make_engine, png_bytes
from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence


@dataclass
class Req:
    rid: str
    prompt: Prompt
    params: SamplingParams
    lora: str | None = None
    salt: str | None = None
    abort_after: int | None = None  # abort once it has streamed this many tokens
    arrive_at: int = 0  # the engine step call before which it is added


@dataclass
class Run:
    outputs: dict[str, list[tuple]] = field(default_factory=dict)
    events: list = field(default_factory=list)
    counters: tuple = ()


def drive(engine: LLMEngine, reqs: list[Req]) -> Run:
    run = Run()
    streamed: dict[str, int] = {}
    calls = 0
    while calls < 5000:
        for r in reqs:
            if r.arrive_at == calls:
                engine.add_request(r.rid, r.prompt, r.params, lora_name=r.lora, cache_salt=r.salt)
        if calls > max(r.arrive_at for r in reqs) and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            run.outputs.setdefault(out.request_id, []).append(
                (
                    out.new_token_ids,
                    out.text_delta,
                    out.finish_reason,
                    out.num_prompt_tokens,
                    out.num_cached_tokens,
                    out.num_output_tokens,
                )
            )
            streamed[out.request_id] = out.num_output_tokens
        for r in reqs:
            if r.abort_after is not None and streamed.get(r.rid) == r.abort_after:
                engine.abort_request(r.rid)
                run.outputs[r.rid].append(("abort",))
                streamed[r.rid] = -1
        run.events += engine.drain_events()
        calls += 1
    s = engine.stats()
    run.counters = (
        s.prefix_queries_tokens,
        s.prefix_hits_tokens,
        s.prompt_tokens_total,
        s.generation_tokens_total,
        engine.scheduler.counters.num_preemptions,
        engine.block_manager.pool.num_free,
    )
    return run


def compare(model_dir: Path, reqs: list[Req], **config: object) -> tuple[Run, LLMEngine]:
    sync = drive(make_engine(model_dir, **config), reqs)
    engine = make_engine(model_dir, async_scheduling=True, **config)
    assert engine._async is not None
    run = drive(engine, reqs)
    assert run.outputs == sync.outputs
    assert run.events == sync.events
    assert run.counters == sync.counters
    assert engine._async.chained > 0  # steps really were launched ahead of their read-back
    return run, engine


def mixed_requests(engine: LLMEngine, rng: random.Random, n: int) -> list[Req]:
    stems = [engine.renderer.render_completion(f"System {i}: " + "be kind. " * 10) for i in (1, 2)]
    reqs = []
    for i in range(n):
        if i % 7 == 3:
            prompt = image_chat(engine, "Look", png_bytes(11 + i % 2), "word " * (i % 9 + 1))
        else:
            stem = list(rng.choice(stems).token_ids)
            tail = [rng.randrange(10, 1900) for _ in range(rng.randrange(1, 30))]
            prompt = Prompt(tuple(stem[: rng.randrange(8, len(stem) + 1)] + tail))
        seeded = i % 3 == 1
        params = SamplingParams(
            temperature=0.9 if seeded else 0.0,
            seed=100 + i if seeded else None,
            top_k=40 if seeded else None,
            max_tokens=rng.randrange(3, 28),
            ignore_eos=True,
        )
        reqs.append(Req(f"r{i}", prompt, params, salt="tenant-b" if i % 5 == 0 else None))
    return reqs


def add_stops(reqs: list[Req], sync: Run) -> None:
    """Stop some requests early on a token, others on a string, from what they generated."""
    for i, r in enumerate(reqs):
        toks = [t for o in sync.outputs[r.rid] for t in o[0]]
        text = "".join(o[1] for o in sync.outputs[r.rid])
        if i % 4 == 1 and len(toks) > 4:
            r.params.stop_token_ids = [toks[3]]
        elif i % 4 == 2 and len(text) > 12:
            r.params.stop = [text[8:11]]


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
    reqs[5].abort_after = 2
    reqs[9].abort_after = 5
    run, async_engine = compare(demo_model_dir, reqs, **config)
    reasons = {o[2] for outs in run.outputs.values() for o in outs if len(o) > 1}
    assert {"stop", "length"} <= reasons
    assert sum(len(outs) for outs in run.outputs.values()) > 100
    assert async_engine.block_manager.pool.num_free == num_blocks
    if num_blocks == 14:  # the cache was under pressure: preemptions, evictions
        assert run.counters[4] > 0
        assert any(isinstance(e, BlockRemoved) for e in run.events)


def test_requests_arriving_mid_stream(demo_model_dir: Path) -> None:
    """Arrivals join a step later than the synchronous engine admits them: outputs equal."""
    config = {"num_blocks": 64, "max_num_seqs": 4}
    engine = make_engine(demo_model_dir, **config)
    reqs = mixed_requests(engine, random.Random(3), 8)
    for i, r in enumerate(reqs):
        r.arrive_at = 3 * i
    sync = drive(make_engine(demo_model_dir, **config), reqs)
    async_engine = make_engine(demo_model_dir, async_scheduling=True, **config)
    run = drive(async_engine, reqs)
    assert run.outputs == sync.outputs
    assert async_engine._async is not None and async_engine._async.chained > 0


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
