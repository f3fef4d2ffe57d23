"""Prefix caching changes nothing but speed: text and image prompts, the ATOM #1358 regression,
under both rules for a match that ends inside an image (partial reuse, the default, and clamp)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import torch

from cachekey import Prompt
from tests.support.engine import (
    generate,
    image_chat,
    make_engine,
    png_bytes,
    run_all,
    sampled_logits,
    tokens,
)
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

BS = 16
LONG_TEXT = "The quick brown fox jumps over the lazy dog while the cat watches. " * 4


@pytest.fixture(scope="module")
def cached(demo_model_dir: Path) -> LLMEngine:
    return make_engine(demo_model_dir, block_size=BS)


@pytest.fixture(scope="module")
def clamped(demo_model_dir: Path) -> LLMEngine:
    return make_engine(demo_model_dir, block_size=BS, mm_match_rule="clamp")


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path) -> LLMEngine:
    return make_engine(demo_model_dir, block_size=BS, enable_prefix_caching=False)


def prompt_logits(engine: LLMEngine, request_id: str) -> torch.Tensor:
    return sampled_logits(engine, request_id)[0]


def assert_same(
    cached: LLMEngine, reference: LLMEngine, prompt: Prompt, tag: str, min_cached: int
) -> int:
    """Run prompt on both engines; equal greedy tokens and prompt logits. The cached tokens."""
    hot = generate(cached, f"{tag}-hot", prompt)
    cold = generate(reference, f"{tag}-cold", prompt)
    assert tokens(hot) == tokens(cold) and len(tokens(hot)) == 8
    torch.testing.assert_close(
        prompt_logits(cached, f"{tag}-hot"),
        prompt_logits(reference, f"{tag}-cold"),
        atol=1e-4,
        rtol=1e-4,
    )
    assert cold[-1].num_cached_tokens == 0
    hit = hot[-1].num_cached_tokens
    assert min_cached <= hit < len(prompt.token_ids) and hit % BS == 0
    return hit


def test_text_prefix_hit_is_exact(cached: LLMEngine, reference: LLMEngine) -> None:
    first = cached.renderer.render_completion(LONG_TEXT + "What does the fox do?")
    second = cached.renderer.render_completion(LONG_TEXT + "Who is watching the dog?")
    generate(cached, "warm-text", first)
    shared = next(
        i for i, (a, b) in enumerate(zip(first.token_ids, second.token_ids, strict=False)) if a != b
    )
    hit = assert_same(cached, reference, second, "text", min_cached=(shared // BS) * BS)
    assert hit == (shared // BS) * BS


@pytest.mark.parametrize("rule", ["partial", "clamp"])
@pytest.mark.parametrize("shared_after", [True, False])
@pytest.mark.parametrize("pad", [0, 5, 11])
def test_image_prefix_hit_is_exact(
    request: pytest.FixtureRequest, reference: LLMEngine, pad: int, shared_after: bool, rule: str
) -> None:
    """Block boundaries fall before, inside and after the image span depending on `pad`.

    With text shared after the image the hit covers the whole span; without, the match ends
    inside the span's last block: "partial" keeps it (the prefill starts mid-image), "clamp"
    rewinds it to the block holding the span start.
    """
    cached: LLMEngine = request.getfixturevalue("cached" if rule == "partial" else "clamped")
    image = png_bytes(seed=100 + pad)
    before = "Look" + " at this" * pad
    common = "Take your time and consider every part of the picture. " if shared_after else ""
    first = image_chat(cached, before, image, common + "What colour dominates?")
    second = image_chat(cached, before, image, common + "Describe the picture in detail.")
    (item,) = second.mm_items
    generate(cached, f"warm-img-{pad}-{shared_after}", first)
    floor_start = (item.offset // BS) * BS
    tag = f"img-{pad}-{shared_after}"
    hit = assert_same(cached, reference, second, tag, min_cached=floor_start)
    shared = next(
        i for i, (a, b) in enumerate(zip(first.token_ids, second.token_ids, strict=False)) if a != b
    )
    matched = (shared // BS) * BS
    inside = item.offset < matched < item.end
    assert inside == (not shared_after and pad < 11)  # pad 11 ends the match past the span
    assert hit == (floor_start if inside and rule == "clamp" else matched)
    if shared_after:
        assert hit >= item.end


@pytest.mark.parametrize("rule", ["partial", "clamp"])
def test_different_images_same_text_atom_1358(
    demo_model_dir: Path, reference: LLMEngine, rule: str
) -> None:
    engine = make_engine(demo_model_dir, block_size=BS, mm_match_rule=rule)
    text_before = "Please look carefully."
    # Long enough that whole blocks follow the image, so a repeat can hit past its span.
    text_after = "What is in this image? Answer in one short sentence and be precise about it."
    images = [png_bytes(seed) for seed in (1, 2, 3)]
    answers = []
    for i, image in enumerate(images):
        prompt = image_chat(engine, text_before, image, text_after)
        (item,) = prompt.mm_items
        out = generate(engine, f"atom-{i}", prompt)
        cold = generate(reference, f"atom-cold-{rule}-{i}", prompt)
        assert tokens(out) == tokens(cold), f"image {i} got another image's answer"
        assert out[-1].num_cached_tokens <= (item.offset // BS) * BS
        if i:
            assert out[-1].num_cached_tokens > 0  # the text before the image is shared
        answers.append(tokens(out))
    assert len({tuple(a) for a in answers}) > 1  # the images really do change the answer
    assert engine.stats().vision_tower_runs == 3
    # The same image again: the hit covers the span, nothing visual is recomputed.
    before = engine.stats()
    prompt = image_chat(engine, text_before, images[1], text_after)
    again = generate(engine, "atom-again", prompt)
    after = engine.stats()
    assert tokens(again) == answers[1]
    assert again[-1].num_cached_tokens >= prompt.mm_items[0].end
    assert after.vision_tower_runs == before.vision_tower_runs
    assert after.images_processed == before.images_processed
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("rule", ["partial", "clamp"])
def test_chunked_prefill_aborted_inside_image(
    demo_model_dir: Path, reference: LLMEngine, rule: str
) -> None:
    """Blocks cached up to the middle of an image: "partial" starts the next prefill there (the
    rest of the image's rows from the encoder cache), "clamp" at the block holding its start."""
    engine = make_engine(
        demo_model_dir, block_size=BS, max_num_batched_tokens=BS * 2, mm_match_rule=rule
    )
    prompt = image_chat(engine, "Hi", png_bytes(7), "Tell me about it.")
    (item,) = prompt.mm_items
    engine.add_request("partial", prompt, SamplingParams(temperature=0.0, max_tokens=8))
    while engine.block_manager.pool.cached.__len__() * BS <= item.offset + BS:
        assert engine.step() == []  # still prefilling
    engine.abort_request("partial")
    assert engine.block_manager.pool.num_free == engine.block_manager.num_blocks
    cached = len(engine.block_manager.pool.cached) * BS
    assert item.offset < cached < item.end
    out = generate(engine, "full", prompt)
    cold = generate(reference, f"full-cold-{rule}", prompt)
    assert tokens(out) == tokens(cold)
    assert out[-1].num_cached_tokens == (cached if rule == "partial" else (item.offset // BS) * BS)
    assert engine.stats().vision_tower_runs == 1  # the encoder cache held the image
    torch.testing.assert_close(
        prompt_logits(engine, "full"),
        prompt_logits(reference, f"full-cold-{rule}"),
        atol=1e-4,
        rtol=1e-4,
    )


def test_batched_requests_match_sequential(cached: LLMEngine, reference: LLMEngine) -> None:
    prompts = [
        cached.renderer.render_completion(f"Story number {i}: " + LONG_TEXT[: 40 + 17 * i])
        for i in range(5)
    ]
    image_prompt = image_chat(cached, "See", png_bytes(42), "and answer")
    prompts.append(image_prompt)
    for i, p in enumerate(prompts):
        cached.add_request(f"batch-{i}", p, SamplingParams(temperature=0.0, max_tokens=8))
    batched = run_all(cached)
    for i, p in enumerate(prompts):
        assert tokens(batched[f"batch-{i}"]) == tokens(generate(reference, f"seq-{i}", p))


@pytest.mark.parametrize("encoder_cache_bytes", [0, 1 << 24])
def test_images_split_across_chunks(
    demo_model_dir: Path, reference: LLMEngine, encoder_cache_bytes: int
) -> None:
    """Chunks of 24 tokens cut both images (one shown twice) mid-span; output is unchanged."""
    engine = make_engine(
        demo_model_dir, max_num_batched_tokens=24, encoder_cache_bytes=encoder_cache_bytes
    )
    a, b = png_bytes(31), png_bytes(32)
    url = "data:image/png;base64,"
    content = [
        {"type": "text", "text": "First"},
        {"type": "image_url", "image_url": {"url": url + base64.b64encode(a).decode()}},
        {"type": "text", "text": "then"},
        {"type": "image_url", "image_url": {"url": url + base64.b64encode(b).decode()}},
        {"type": "text", "text": "and again"},
        {"type": "image_url", "image_url": {"url": url + base64.b64encode(a).decode()}},
        {"type": "text", "text": "compare them."},
    ]
    prompt = engine.renderer.render_chat([{"role": "user", "content": content}])
    assert len(prompt.mm_items) == 3
    out = generate(engine, "multi", prompt)
    cold = generate(reference, f"multi-cold-{encoder_cache_bytes}", prompt)
    assert tokens(out) == tokens(cold)
    torch.testing.assert_close(
        prompt_logits(engine, "multi"),
        prompt_logits(reference, f"multi-cold-{encoder_cache_bytes}"),
        atol=1e-4,
        rtol=1e-4,
    )
    stats = engine.stats()
    assert stats.images_processed == 3
    if encoder_cache_bytes:
        assert stats.vision_tower_runs == 2  # a and b once each, then served from the cache
        assert stats.encoder_cache_hits > 0
    else:  # no cache: every chunk that touches an image re-encodes it
        assert stats.vision_tower_runs > 3 and stats.encoder_cache_hits == 0
