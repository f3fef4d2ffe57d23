"""Requests that share a prefix and overlap in the engine: the later one waits for the blocks
the earlier one is computing, then hits all of them (what the gateway predicts for it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachekey.events import BlockStored
from tests.support.engine import run_all
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

BS = 16
SHARED = "A long system prompt that every tenant request starts with. " * 8
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def sim_engine(model_dir: Path, **kw: object) -> LLMEngine:
    # A small step budget: a prefill takes several steps, so requests overlap mid-prefill.
    settings: dict[str, object] = {"num_blocks": 256, "max_num_batched_tokens": 48}
    settings.update(kw)
    return LLMEngine(EngineConfig(model=str(model_dir), engine="sim", **settings))  # type: ignore[arg-type]


def _shared_blocks(a: list[int], b: list[int]) -> int:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return n // BS


def test_a_request_waits_for_the_prefix_a_running_one_computes(demo_model_dir: Path) -> None:
    engine = sim_engine(demo_model_dir)
    first = engine.renderer.render_completion(SHARED + "What is the first question?")
    second = engine.renderer.render_completion(SHARED + "And here is another one.")
    other = engine.renderer.render_completion("Nothing in common with the others at all. " * 3)
    shared = _shared_blocks(first.token_ids, second.token_ids)
    assert shared >= 8
    engine.add_request("first", first, PARAMS)
    engine.add_request("second", second, PARAMS)
    engine.add_request("other", other, PARAMS)
    engine.step()  # first is admitted and starts its prefill; second must not start its own
    assert engine.scheduler.waiting[0].request_id == "second"
    out = run_all(engine)
    assert out["first"][-1].num_cached_tokens == 0
    assert out["second"][-1].num_cached_tokens == shared * BS  # the whole shared prefix
    assert out["other"][-1].num_cached_tokens == 0
    # Every shared block was computed and published once: no second copy.
    stored = [
        h for e in engine.drain_events() if isinstance(e, BlockStored) for h in e.block_hashes
    ]
    assert len(stored) == len(set(stored))
    # The unrelated request did not wait behind the deferred one.
    assert out["other"][0].queue_s < out["second"][0].queue_s


def test_first_token_carries_queue_and_prefill_intervals(demo_model_dir: Path) -> None:
    engine = sim_engine(demo_model_dir, sim_prefill_s_per_token=0.0005)
    prompt = engine.renderer.render_completion(SHARED)
    engine.add_request("a", prompt, PARAMS)
    out = run_all(engine)["a"]
    first, later = out[0], out[1:]
    assert first.queue_s is not None and first.queue_s >= 0
    # Several steps of 48 tokens at 0.5 ms per token.
    assert first.prefill_s is not None and first.prefill_s >= 0.0005 * len(prompt.token_ids)
    assert later and all(o.queue_s is None and o.prefill_s is None for o in later)


@pytest.mark.parametrize("caching", [True, False])
def test_only_a_shared_cached_prefix_is_waited_for(demo_model_dir: Path, caching: bool) -> None:
    """Room for both in one step: with prefix caching the twin waits for the blocks and hits
    them; without it there is nothing to wait for and both start at once."""
    engine = sim_engine(demo_model_dir, max_num_batched_tokens=4096, enable_prefix_caching=caching)
    prompt = engine.renderer.render_completion(SHARED + "Same question twice.")
    engine.add_request("a", prompt, PARAMS)
    engine.add_request("b", prompt, PARAMS)
    engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == (["b"] if caching else [])
    out = run_all(engine)
    assert out["a"][-1].num_cached_tokens == 0
    expected = ((len(prompt.token_ids) - 1) // BS) * BS if caching else 0
    assert out["b"][-1].num_cached_tokens == expected


def test_a_queued_requests_cached_prefix_is_evicted_last(demo_model_dir: Path) -> None:
    """A request behind a cold one that needs most of the cache still hits its prefix: the
    prefix became the newest in the LRU when the request arrived."""
    engine = sim_engine(demo_model_dir, num_blocks=26, max_num_batched_tokens=512)
    render = engine.renderer.render_completion
    mine = render("alpha beta gamma delta " * 12)  # 10 blocks
    engine.add_request("mine", mine, PARAMS)
    run_all(engine)
    engine.add_request("later", render("one two three four five " * 10), PARAMS)
    run_all(engine)  # its blocks are newer in the LRU than mine
    engine.add_request("cold", render("red green blue yellow black white " * 14), PARAMS)
    engine.add_request("again", mine, PARAMS)  # queued behind the cold one's 15 blocks
    out = run_all(engine)
    assert out["again"][-1].num_cached_tokens == ((len(mine.token_ids) - 1) // BS) * BS
