"""--async-scheduling on steps that carry prompt chunks and admissions, not only decode rows: a
step is launched while the one before it runs when it admits requests or carries a prompt chunk
(`AsyncSteps.chained_mixed`), and a row whose prompt ended in the step in flight takes its first
token from that step's tensor. Against the synchronous engine on requests arriving while others
decode: chunked prefill under a small token budget, prefix hits, stop tokens and strings,
max_tokens, a small KV pool with preemption; the whole runs are equal (outputs with their usage,
the KV event stream, the counters), also where an admission had to wait for the step in flight
(`Scheduler.admit_more`)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cachekey.events import BlockRemoved
from tests.support.async_runs import Req, add_stops, compare, drive, mixed_requests
from tests.support.engine import make_engine
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams


def staggered(engine: LLMEngine, seed: int, n: int, every: int) -> list[Req]:
    reqs = mixed_requests(engine, random.Random(seed), n)
    for i, r in enumerate(reqs):
        r.arrive_at = every * i
    add_stops(reqs, drive(engine, reqs))
    return reqs


def test_prompt_chunks_and_admissions_beside_decodes(demo_model_dir: Path) -> None:
    """A 24-token budget chunks most prompts; arrivals every other step join decoding rows."""
    config = {"num_blocks": 96, "max_num_seqs": 8, "max_num_batched_tokens": 24}
    engine = make_engine(demo_model_dir, **config)
    reqs = staggered(engine, 5, 12, 2)
    assert max(len(r.prompt.token_ids) for r in reqs) > 2 * 24  # chunked over several steps
    run, async_engine = compare(demo_model_dir, reqs, **config)
    steps = async_engine._async
    assert steps is not None and steps.chained_mixed >= 5
    assert run.counters[1] > 0  # prefix hits
    reasons = {o[2] for outs in run.outputs.values() for o in outs}
    assert {"stop", "length"} <= reasons


def test_a_small_pool_and_held_admissions(demo_model_dir: Path) -> None:
    """Few blocks and seats: preemptions, evictions, and admissions that waited for the step in
    flight to be read back (a row it may finish would free a seat or blocks)."""
    config = {"num_blocks": 16, "max_num_seqs": 5, "max_num_batched_tokens": 48}
    engine = make_engine(demo_model_dir, **config)
    reqs = staggered(engine, 9, 10, 1)
    run, async_engine = compare(demo_model_dir, reqs, **config)
    steps = async_engine._async
    assert steps is not None and steps.refused["held"] > 0 and steps.chained_mixed > 0
    assert run.counters[4] > 0  # preemptions
    assert any(isinstance(e, BlockRemoved) for e in run.events)
    assert async_engine.block_manager.pool.num_free == 16


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_first_tokens_come_one_read_back_later(demo_model_dir: Path, async_scheduling) -> None:
    """A first token is read back while the next step runs (one call later than the synchronous
    engine returns it), that next step taking it on the device; an arrival while another request
    decodes is admitted by a step launched ahead."""
    engine = make_engine(demo_model_dir, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = engine.renderer.render_completion("Paged attention keeps blocks. " * 3)
    engine.add_request("a", prompt, params)
    calls = [[(o.request_id, o.num_output_tokens) for o in engine.step()]]
    calls.append([(o.request_id, o.num_output_tokens) for o in engine.step()])
    engine.add_request("b", prompt, params)  # arrives while "a" decodes
    while engine.has_unfinished_requests():
        calls.append([(o.request_id, o.num_output_tokens) for o in engine.step()])
    lag = int(async_scheduling)
    assert calls[0 + lag] == [("a", 1)]
    assert ("b", 1) in calls[2 + lag]  # admitted at call 2, its prompt's step: no later
    if async_scheduling:
        steps = engine._async
        assert steps is not None
        assert calls[0] == [] and steps.chained_mixed == 1  # "b" joined the decoding "a"
        assert steps.chained == len(calls) - 2  # every step but the first and an empty last
