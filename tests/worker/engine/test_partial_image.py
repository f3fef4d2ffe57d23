"""Prefix hits that end inside an image (`--mm-match-rule partial`, the default), checked with
real forward passes in float32: the prefill starts mid-image with the right slice of the image's
embeddings, so logits and greedy tokens equal the same request computed cold. Also: chunks that
start and end inside an image, preemption and recompute, LoRA and cache_salt, the encoder cache
losing the image between the hit and the prefill, a prompt that ends with an image, and a
request that waits for an image prefix in flight. The no-false-hit cases (ATOM #1358) are in
tests/worker/engine/test_prefix_cache.py and tests/worker/engine/test_block_manager.py, run on
this rule too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachekey import MMItem, Prompt
from tests.support.engine import (
    GREEDY,
    generate,
    image_chat,
    make_engine,
    png_bytes,
    run_all,
    sampled_logits,
    tokens,
)
from worker.engine.llm_engine import LLMEngine, RequestOutput
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import SequenceStatus

BS = 16
IMAGE_BYTES = 64 * 128 * 4  # one demo image's embeddings: 64 rows of 128 float32


@pytest.fixture(scope="module")
def cold(demo_model_dir: Path) -> LLMEngine:
    return make_engine(demo_model_dir, block_size=BS, enable_prefix_caching=False)


def assert_same_as_cold(
    hot: LLMEngine,
    hot_id: str,
    cold: LLMEngine,
    prompt: Prompt,
    out: list[RequestOutput],
    lora_name: str | None = None,
) -> None:
    """The request's greedy tokens and first logits equal those of the cold engine's run."""
    cold.add_request(f"cold-{hot_id}", prompt, GREEDY, lora_name=lora_name)
    ref = run_all(cold)[f"cold-{hot_id}"]
    assert tokens(out) == tokens(ref)
    torch.testing.assert_close(
        sampled_logits(hot, hot_id)[0],
        sampled_logits(cold, f"cold-{hot_id}")[0],
        atol=1e-4,
        rtol=1e-4,
    )


def matched(first: Prompt, second: Prompt) -> int:
    """The whole blocks the two prompts share."""
    pairs = zip(first.token_ids, second.token_ids, strict=False)
    return (next(i for i, (a, b) in enumerate(pairs) if a != b) // BS) * BS


def cache_up_to_inside(engine: LLMEngine, prompt: Prompt, rid: str) -> int:
    """Prefill `prompt` in chunks until at least two blocks past the image start are cached,
    then abort it: the cache holds blocks that end inside the image. Their token count."""
    (item,) = prompt.mm_items
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while len(engine.block_manager.pool.cached) * BS <= item.offset + BS:
        assert engine.step() == []  # still prefilling
    engine.abort_request(rid)
    cached = len(engine.block_manager.pool.cached) * BS
    assert item.offset < cached < item.end
    return cached


@pytest.mark.parametrize("encoder_cache_bytes", [0, 1 << 24])
def test_chunks_that_start_and_end_inside_an_image(
    demo_model_dir: Path, cold: LLMEngine, encoder_cache_bytes: int
) -> None:
    """The hit ends 2+ blocks into the image; 20-token chunks then start and end inside it."""
    engine = make_engine(
        demo_model_dir,
        block_size=BS,
        max_num_batched_tokens=20,
        encoder_cache_bytes=encoder_cache_bytes,
    )
    image = png_bytes(61)
    first = image_chat(engine, "Hi", image, "Tell me about it.")
    cached = cache_up_to_inside(engine, first, "aborted")
    second = image_chat(engine, "Hi", image, "What is the main colour in it?")
    (item,) = second.mm_items
    assert item.end - cached > 20  # the first chunk after the hit ends inside the image too
    runs = engine.stats().vision_tower_runs
    out = generate(engine, "mid", second)
    assert out[-1].num_cached_tokens == cached
    assert_same_as_cold(engine, "mid", cold, second, out)
    tower = engine.stats().vision_tower_runs - runs
    if encoder_cache_bytes:
        assert tower == 0  # the aborted prefill's embeddings serve the rest of the image
    else:  # no cache: each chunk that has image rows runs the tower on the whole image
        assert tower == -(-(item.end - cached) // 20)


@pytest.mark.parametrize("when", ["before_admission", "between_hit_and_prefill"])
def test_the_encoder_cache_loses_the_image(
    demo_model_dir: Path, cold: LLMEngine, when: str
) -> None:
    """The image's embeddings are gone when the rest of it is computed: the vision tower runs
    again on the whole image, and the result is unchanged."""
    engine = make_engine(demo_model_dir, block_size=BS, encoder_cache_bytes=IMAGE_BYTES)
    x, y = png_bytes(71), png_bytes(72)
    first = image_chat(engine, "Look:", x, "what is it?")
    generate(engine, "warm", first)
    prompt = image_chat(engine, "Look:", x, "which colours do you see, and where?")
    (item,) = prompt.mm_items
    cache = engine.runner.vision.cache
    assert item.identifier in cache
    runs = engine.stats().vision_tower_runs
    hit = matched(first, prompt)
    assert item.offset < hit < item.end
    if when == "before_admission":
        generate(engine, "evict", image_chat(engine, "Another", y, "one"))  # holds one image
        assert item.identifier not in cache
        runs += 1
        out = generate(engine, "partial", prompt)
    else:
        engine.add_request("partial", prompt, GREEDY)

        def lose_the_image() -> None:  # admitted, the hit decided; the forward pass is next
            assert [s.num_computed_tokens for s in engine.scheduler.running] == [hit]
            cache.clear()

        out = engine.step(lose_the_image) + run_all(engine).get("partial", [])
    assert out[-1].num_cached_tokens == hit
    assert engine.stats().vision_tower_runs == runs + 1
    assert_same_as_cold(engine, "partial", cold, prompt, out)


def test_preemption_recomputes_from_inside_an_image(demo_model_dir: Path, cold: LLMEngine) -> None:
    """A long decode and a chunked image prefill do not both fit in 8 blocks: the image request
    is preempted mid-prefill and re-admitted on its cached blocks, which end inside the image."""
    engine = make_engine(
        demo_model_dir, block_size=BS, num_blocks=8, max_num_batched_tokens=32, max_num_seqs=2
    )
    text = engine.renderer.render_completion("Count " * 10)
    # As long as 8 blocks allow (one token of them is never computed).
    long = SamplingParams(temperature=0.0, max_tokens=8 * BS - len(text) - 1, ignore_eos=True)
    image = image_chat(engine, "Hi", png_bytes(5), "Tell me about it in detail.")
    (item,) = image.mm_items
    engine.add_request("text", text, long)
    engine.step()
    engine.add_request("image", image, GREEDY)
    seq = engine.scheduler.waiting[-1]
    assert seq.request_id == "image"
    status, readmitted_at = SequenceStatus.WAITING, []

    def note_admission() -> None:  # each step, once scheduled: where a (re)admission starts
        nonlocal status
        if status is SequenceStatus.WAITING and seq.status is SequenceStatus.RUNNING:
            readmitted_at.append(seq.num_computed_tokens)
        status = seq.status

    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step(note_admission):
            outputs.setdefault(out.request_id, []).append(out)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.counters.num_preemptions > 0
    assert any(item.offset < n < item.end for n in readmitted_at[1:]), readmitted_at
    assert_same_as_cold(engine, "image", cold, image, outputs["image"])
    assert tokens(outputs["text"]) == tokens(generate(cold, "cold-text", text, long))
    assert engine.block_manager.pool.num_free == engine.block_manager.num_blocks


def test_cache_salt_scopes_partial_reuse(demo_model_dir: Path, cold: LLMEngine) -> None:
    engine = make_engine(demo_model_dir, block_size=BS)
    image = png_bytes(81)
    first = image_chat(engine, "Look:", image, "what is it?")
    engine.add_request("warm", first, GREEDY, cache_salt="tenant-a")
    run_all(engine)
    second = image_chat(engine, "Look:", image, "and what else is there to see?")
    (item,) = second.mm_items
    hits = {}
    for salt in ("tenant-a", "tenant-b", None):
        engine.add_request(f"salt-{salt}", second, GREEDY, cache_salt=salt)
        out = run_all(engine)[f"salt-{salt}"]
        hits[salt] = out[-1].num_cached_tokens
        assert_same_as_cold(engine, f"salt-{salt}", cold, second, out)
    assert item.offset < hits["tenant-a"] < item.end
    assert hits["tenant-b"] == hits[None] == 0


def test_lora_scopes_partial_reuse(demo_model_dir: Path, tmp_path: Path) -> None:
    from worker.demo.lora import DEMO_ADAPTERS, write_demo_adapter

    modules = tuple(f"{n}={write_demo_adapter(tmp_path / n, n)}" for n in DEMO_ADAPTERS)
    lora = {"enable_lora": True, "max_loras": 2, "lora_modules": modules}
    engine = make_engine(demo_model_dir, block_size=BS, **lora)
    cold = make_engine(demo_model_dir, block_size=BS, enable_prefix_caching=False, **lora)
    image = png_bytes(91)
    engine.add_request(
        "warm", image_chat(engine, "Look:", image, "what is it?"), GREEDY, lora_name="alpha"
    )
    run_all(engine)
    second = image_chat(engine, "Look:", image, "and what else is there to see?")
    (item,) = second.mm_items
    hits = {}
    for name in ("alpha", "beta", None):
        engine.add_request(f"lora-{name}", second, GREEDY, lora_name=name)
        out = run_all(engine)[f"lora-{name}"]
        hits[name] = out[-1].num_cached_tokens
        assert_same_as_cold(engine, f"lora-{name}", cold, second, out, lora_name=name)
    assert item.offset < hits["alpha"] < item.end
    assert hits["beta"] == hits[None] == 0


def test_a_prompt_that_ends_with_an_image_still_computes_its_last_token(
    demo_model_dir: Path, cold: LLMEngine
) -> None:
    engine = make_engine(demo_model_dir, block_size=BS)
    text = engine.renderer.render_completion("Describe this picture:").token_ids
    image_token = engine.assets.image.image_token_id
    item = MMItem("tail-image", "image", len(text), 64)
    prompt = Prompt((*text, *[image_token] * 64), (item,), {item.identifier: png_bytes(101)})
    generate(engine, "first", prompt)
    runs = engine.stats().vision_tower_runs
    out = generate(engine, "again", prompt)
    assert out[-1].num_cached_tokens == ((len(prompt) - 1) // BS) * BS > item.offset
    assert engine.stats().vision_tower_runs == runs  # its last rows came from the encoder cache
    assert_same_as_cold(engine, "again", cold, prompt, out)


@pytest.mark.parametrize("rule", ["partial", "clamp"])
def test_a_request_waits_for_an_image_prefix_in_flight(
    demo_model_dir: Path, cold: LLMEngine, rule: str
) -> None:
    """Two questions about one image arrive together; the second is deferred while the first
    computes the shared blocks, then hits them (partial) or up to the image (clamp). No stall."""
    engine = make_engine(
        demo_model_dir, block_size=BS, max_num_batched_tokens=24, mm_match_rule=rule
    )
    image = png_bytes(111)
    first = image_chat(engine, "Look:", image, "what is it?")
    second = image_chat(engine, "Look:", image, "and what else is there to see?")
    (item,) = second.mm_items
    engine.add_request("first", first, GREEDY)
    engine.add_request("second", second, GREEDY)
    out = run_all(engine, max_steps=200)
    shared = matched(first, second)
    assert item.offset < shared < item.end
    hit = out["second"][-1].num_cached_tokens
    assert hit == (shared if rule == "partial" else (item.offset // BS) * BS)
    assert engine.stats().vision_tower_runs == 1
    for rid, prompt in (("first", first), ("second", second)):
        assert_same_as_cold(engine, rid, cold, prompt, out[rid])


def test_a_tower_and_a_renderer_that_disagree_on_an_image_refuse_to_start(
    demo_model_dir: Path,
) -> None:
    """Each step copies image rows by position, so a span whose length is not the tower's row
    count would misplace rows: the engine refuses such a model at load, not mid-request."""
    import dataclasses

    from cachekey.assets import ModelAssets
    from worker.engine.config import EngineConfig
    from worker.engine.model_runner import ModelRunner

    assets = ModelAssets.from_dir(demo_model_dir)
    assert assets.image is not None
    assets.image = dataclasses.replace(assets.image, tokens_per_image=63)
    config = EngineConfig(model=str(demo_model_dir), device="cpu", dtype="float32", num_blocks=8)
    with pytest.raises(ValueError, match="63 placeholder tokens but the vision tower returns 64"):
        ModelRunner(config, assets)
