"""The host KV tier with a real torch forward pass (the demo LLaVA, float32, greedy): blocks the
small GPU pool evicts go to host memory and come back as cached tokens, and every output equals
the same engine's without the tier: text, images, LoRA adapters, cache salts, preemption."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cachekey import Prompt
from tests.support.engine import image_chat, make_engine, png_bytes, run_all, tokens
from worker.engine.llm_engine import LLMEngine, RequestOutput
from worker.engine.sampling_params import SamplingParams

BS = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    from worker.demo.lora import DEMO_ADAPTERS, write_demo_adapter

    root = tmp_path_factory.mktemp("host-tier-lora")
    return tuple(f"{n}={write_demo_adapter(root / n, n)}" for n in DEMO_ADAPTERS)


def engines(demo_model_dir: Path, adapters: tuple[str, ...], **kw: object):
    common = {"enable_lora": True, "max_loras": 2, "lora_modules": adapters, **kw}
    on = make_engine(demo_model_dir, kv_offload_bytes=8 << 20, **common)
    off = make_engine(demo_model_dir, **common)
    return on, off


def workload(engine: LLMEngine, adapters: tuple[str, ...]) -> list[tuple[Prompt, dict]]:
    """Five requests of a few blocks each: text, two images, an adapter, a salt."""
    lora = adapters[0].split("=")[0]
    text = engine.renderer.render_completion
    return [
        (text("A shared system prompt, long enough for blocks. " * 3), {}),
        (image_chat(engine, "Look:", png_bytes(3), "what is it? " * 4), {}),
        (image_chat(engine, "Look:", png_bytes(4), "what is it? " * 4), {}),
        (text("An adapter's own prompt, several blocks of it. " * 3), {"lora_name": lora}),
        (text("A shared system prompt, long enough for blocks. " * 3), {"cache_salt": "t1"}),
    ]


def serve(engine: LLMEngine, name: str, prompt: Prompt, kw: dict) -> list[RequestOutput]:
    engine.add_request(name, prompt, PARAMS, **kw)
    return run_all(engine)[name]


def test_outputs_equal_with_the_tier_on_and_off(demo_model_dir: Path, adapters) -> None:
    on, off = engines(demo_model_dir, adapters, num_blocks=12)
    assert on.block_manager.host is not None and off.block_manager.host is None
    work = workload(on, adapters)
    assert all(len(p.token_ids) > 3 * BS for p, _ in work)
    host_parts: list[int | None] = []
    for round_ in range(2):
        for i, (prompt, kw) in enumerate(work):
            name = f"r{round_}-{i}"
            got, want = serve(on, name, prompt, kw), serve(off, name, prompt, kw)
            assert tokens(got) == tokens(want), f"{name} diverged"
            full = (len(prompt.token_ids) - 1) // BS * BS
            if round_ == 0 and kw.get("cache_salt"):
                # The same tokens as request 0, another salt: none of its blocks, in any tier.
                assert got[-1].num_cached_tokens == 0
            if round_ == 1:
                # The GPU pool holds about two of these: the tier keeps them all.
                assert got[-1].num_cached_tokens == full, name
                assert want[-1].num_cached_tokens < full, name
            assert want[-1].num_host_cached_tokens is None  # no tier: no part of it
            host_parts.append(got[-1].num_host_cached_tokens)
    stats = on.stats()
    assert stats.host_hits_tokens > 0 and stats.host_loaded_bytes > 0
    # Each request's host part, summed, is what the engine counts as the tier's hits.
    assert sum(host_parts) == stats.host_hits_tokens  # type: ignore[arg-type]
    assert stats.host_saved_bytes > 0 and off.stats().host_hits_tokens == 0
    assert stats.host_load_seconds > 0  # the plain copies' time (vllm:kv_offload_load_time)


def test_a_different_image_never_hits_the_host_tier(demo_model_dir: Path, adapters) -> None:
    on, _ = engines(demo_model_dir, adapters, num_blocks=12)
    first = image_chat(on, "Look:", png_bytes(3), "what is it? " * 4)
    serve(on, "a", first, {})
    serve(on, "evict", on.renderer.render_completion("Filler words to evict it. " * 12), {})
    assert on.block_manager.host is not None and on.block_manager.host.entries
    other = image_chat(on, "Look:", png_bytes(9), "what is it? " * 4)
    assert other.token_ids == first.token_ids  # the same placeholders, another image
    out = serve(on, "b", other, {})
    image = other.mm_items[0]
    assert out[-1].num_cached_tokens <= image.offset // BS * BS  # nothing past its start


def test_preemption_with_the_tier_keeps_outputs(demo_model_dir: Path) -> None:
    on = make_engine(demo_model_dir, num_blocks=10, max_num_seqs=8, kv_offload_blocks=32)
    prompts = [
        on.renderer.render_completion(f"Request {i} says " + "hello " * (8 + 3 * i))
        for i in range(6)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        on.add_request(f"c{i}", p, params)
    together = run_all(on)
    assert on.scheduler.counters.num_preemptions > 0
    host = on.block_manager.host
    assert host is not None and host.counters.loaded_blocks > 0  # recomputed from host memory
    alone = make_engine(demo_model_dir, num_blocks=64, enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        alone.add_request(f"a{i}", p, params)
        want = run_all(alone)[f"a{i}"]
        assert tokens(together[f"c{i}"]) == tokens(want), f"request {i} diverged"


def test_hidden_states_come_back_with_the_kv(demo_model_dir: Path) -> None:
    """A block's hidden-state rows travel with its K/V: a host hit's hidden states equal the
    ones an engine without a prefix cache computes."""
    layers = {"hidden_state_layers": (0, 1)}
    on = make_engine(demo_model_dir, num_blocks=20, kv_offload_blocks=64, **layers)
    cold = make_engine(demo_model_dir, enable_prefix_caching=False, **layers)
    base = tuple(100 + (5 * i) % 700 for i in range(10 * BS))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    on.add_request("a", Prompt(base), one)
    run_all(on)
    for k in range(3):  # fresh prompts that need more blocks than are free
        on.add_request(f"o{k}", Prompt(tuple(800 + (11 * i + k) % 900 for i in range(5 * BS))), one)
        run_all(on)
    probe = Prompt((*base, 5, 6, 7))
    outs = []
    for engine in (on, cold):
        engine.add_request("probe", probe, one, hidden_states="all")
        outs.append(run_all(engine)["probe"][-1])
    assert outs[0].num_cached_tokens == 10 * BS and on.stats().host_hits_tokens > 0
    assert 0 < outs[0].num_host_cached_tokens <= 10 * BS  # type: ignore[operator]
    assert outs[0].hidden_states is not None and outs[1].hidden_states is not None
    np.testing.assert_allclose(outs[0].hidden_states, outs[1].hidden_states, atol=1e-4, rtol=1e-4)
