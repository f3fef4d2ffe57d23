"""Driving an engine with --async-scheduling and one without on the same requests, and holding
the two runs to each other (tests/worker/engine/test_async_*.py; no tests here)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from cachekey import Prompt
from tests.support.engine import image_chat, make_engine, png_bytes
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams


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


def compare(
    model_dir: Path, reqs: list[Req], *, exact: bool = True, **config: object
) -> tuple[Run, LLMEngine]:
    """exact: the whole runs are equal (outputs with their usage, the KV event stream, the
    counters). Else (requests aborted on what they streamed, which reaches an engine with a step
    in flight one step later) the tokens, text and finish reasons each request streamed."""
    sync = drive(make_engine(model_dir, **config), reqs)
    engine = make_engine(model_dir, async_scheduling=True, **config)
    assert engine._async is not None
    run = drive(engine, reqs)
    if exact:
        assert run.outputs == sync.outputs
        assert run.events == sync.events
        assert run.counters == sync.counters
    else:
        assert streamed(run) == streamed(sync)
    assert engine._async.chained > 0  # steps really were launched ahead of their read-back
    return run, engine


def streamed(run: Run) -> dict[str, list[tuple]]:
    return {rid: [o[:3] for o in outs] for rid, outs in run.outputs.items()}


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
