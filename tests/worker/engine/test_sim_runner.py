"""The sim engine: real scheduler, block manager and events; a timing model for the forward."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from cachekey.events import BlockStored
from tests.support.engine import image_chat, png_bytes, run_all, tokens
from tests.support.paths import REPO
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams


def sim_engine(model_dir: Path, **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), engine="sim", **kw))  # type: ignore[arg-type]


def test_sim_engine_does_not_import_torch(demo_model_dir: Path) -> None:
    code = (
        "import sys\n"
        "from worker.engine.config import EngineConfig\n"
        "from worker.engine.llm_engine import LLMEngine\n"
        "from worker.engine.sampling_params import SamplingParams\n"
        f"e = LLMEngine(EngineConfig(model={str(demo_model_dir)!r}, engine='sim'))\n"
        "e.add_request('a', e.renderer.render_completion('hi there'), SamplingParams())\n"
        "while e.has_unfinished_requests(): e.step()\n"
        "assert 'torch' not in sys.modules, 'sim imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_sim_is_deterministic_and_caches(demo_model_dir: Path) -> None:
    engine = sim_engine(demo_model_dir, num_blocks=64)
    prompt = engine.renderer.render_completion("A fairly long shared system prompt. " * 6)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request("a", prompt, params)
    first = run_all(engine)["a"]
    engine.add_request("b", prompt, params)
    second = run_all(engine)["b"]
    assert tokens(first) == tokens(second) and len(tokens(first)) == 6
    assert "".join(o.text_delta for o in first).strip()  # plausible text, not nothing
    assert second[-1].num_cached_tokens == ((len(prompt.token_ids) - 1) // 16) * 16
    events = engine.drain_events()
    assert any(isinstance(e, BlockStored) for e in events)
    other = engine.renderer.render_completion("Something else entirely, for another answer.")
    engine.add_request("c", other, params)
    assert tokens(run_all(engine)["c"]) != tokens(first)


def test_sim_timing_model_charges_uncached_prefill(demo_model_dir: Path) -> None:
    engine = sim_engine(demo_model_dir, sim_prefill_s_per_token=0.002, sim_decode_s_per_step=0.0)
    image = png_bytes(5)
    prompt = image_chat(engine, "Here:", image, "describe it. " * 10)
    params = SamplingParams(max_tokens=1)
    t0 = time.perf_counter()
    engine.add_request("cold", prompt, params)
    run_all(engine)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.add_request("warm", prompt, params)
    warm_out = run_all(engine)["warm"]
    warm = time.perf_counter() - t0
    n = len(prompt.token_ids)
    assert cold >= 0.002 * n
    assert warm < 0.002 * (n - warm_out[-1].num_cached_tokens) + 0.05
    assert warm_out[-1].num_cached_tokens > prompt.mm_items[0].end - 16
    assert engine.stats().images_processed == 1  # the warm request skipped the image span


def test_events_snapshot_and_reset(demo_model_dir: Path) -> None:
    from cachekey.events import AllBlocksCleared, decode_batch, encode_batch

    engine = sim_engine(demo_model_dir, num_blocks=64)
    prompt = engine.renderer.render_completion("Snapshot me, please. " * 8)
    engine.add_request("a", prompt, SamplingParams(max_tokens=3))
    engine.step()
    assert engine.reset_prefix_cache() is False  # blocks in use: refused, like vLLM
    run_all(engine)
    snap = engine.snapshot_blocks()
    seen: set[bytes] = set()
    for block in snap:  # parents first, and each key chains to the one before it
        assert block.parent is None or block.parent in seen
        seen.add(block.key)
    batch = decode_batch(encode_batch(engine.drain_events(), dp_rank=0))
    stored = [h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == [b.key for b in snap] and all(len(h) == 16 for h in stored)
    assert engine.reset_prefix_cache() is True
    assert engine.snapshot_blocks() == [] and isinstance(
        engine.drain_events()[-1], AllBlocksCleared
    )
    assert engine.drain_events() == []


def test_kv_cache_sized_from_memory_budget(demo_model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(model=str(demo_model_dir), device="cpu", kv_cache_memory_bytes=1 << 20)
    )
    per_block = engine.runner.info.kv_bytes_per_token() * 16
    # One block of the budget is the spare block that padded decode rows write to.
    assert engine.stats().num_blocks == (1 << 20) // per_block - 1
    assert engine.runner.kv_cache.nbytes <= 1 << 20
