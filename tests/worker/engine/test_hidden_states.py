"""Hidden states with prefix caching equal those without it (1e-4, float32): text, images,
lengths off the block size, hits that end inside an image span, evicted blocks, preemption."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cachekey import Prompt, block_keys
from cachekey.events import BlockRemoved
from tests.support.engine import image_chat, make_engine, png_bytes, run_all
from worker.engine.hidden_reads import HiddenStatesUnavailable
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

BS = 16
LAYERS = (0, 1)  # the demo model has 2 layers: rows are hidden_states[0], [1] and the final [2]
TEXT = "The quick brown fox jumps over the lazy dog while the cat watches. " * 5


def params(max_tokens: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def hot(demo_model_dir: Path) -> LLMEngine:
    return make_engine(demo_model_dir, block_size=BS, hidden_state_layers=LAYERS)


@pytest.fixture(scope="module")
def cold(demo_model_dir: Path) -> LLMEngine:
    return make_engine(
        demo_model_dir, block_size=BS, hidden_state_layers=LAYERS, enable_prefix_caching=False
    )


def hidden(
    engine: LLMEngine, rid: str, prompt: Prompt, pooling: str, max_tokens: int = 1
) -> tuple[np.ndarray, int]:
    """The request's hidden states and its prefix-cache hit."""
    engine.add_request(rid, prompt, params(max_tokens), hidden_states=pooling)
    final = run_all(engine)[rid][-1]
    assert final.finished and final.hidden_states is not None
    return final.hidden_states, final.num_cached_tokens


def assert_same(
    hot: LLMEngine,
    cold: LLMEngine,
    prompt: Prompt,
    tag: str,
    poolings=("all", "mean", "last"),
    **kw,
) -> int:
    """Each pooling on both engines, equal within 1e-4; the hot engine's first hit (the runs
    after it hit every full block but the last: they are compared too)."""
    hits = []
    for pooling in poolings:
        a, hit = hidden(hot, f"{tag}-{pooling}-hot", prompt, pooling, **kw)
        b, cold_hit = hidden(cold, f"{tag}-{pooling}-cold", prompt, pooling, **kw)
        assert cold_hit == 0 and a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=f"{tag} {pooling}")
        hits.append(hit)
    assert hits[1:] == [((len(prompt) - 1) // BS) * BS] * (len(hits) - 1)
    return hits[0]


def shared_len(a: Prompt, b: Prompt) -> int:
    return next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y)


def test_text_prefix_hit(hot: LLMEngine, cold: LLMEngine) -> None:
    first = hot.renderer.render_completion(TEXT + "What does the fox do?")
    second = hot.renderer.render_completion(TEXT + "Who is watching the dog?")
    hidden(hot, "text-warm", first, "last")
    hit = assert_same(hot, cold, second, "text")
    assert hit == (shared_len(first, second) // BS) * BS > 0


def test_shapes_and_layers(hot: LLMEngine) -> None:
    prompt = hot.renderer.render_completion(TEXT + "Shapes.")
    n = len(prompt)
    rows, _ = hidden(hot, "shape-all", prompt, "all", max_tokens=4)
    # Every token the model ran: the prompt and the generated ones but the last.
    assert rows.shape == (len(LAYERS) + 1, n + 3, hot.runner.info.hidden_size)
    assert hot.runner.hidden.row_layers == (0, 1, 2)
    last, _ = hidden(hot, "shape-last", prompt, "last")
    mean, _ = hidden(hot, "shape-mean", prompt, "mean")
    np.testing.assert_allclose(last, rows[-1, n - 1], atol=1e-5)
    np.testing.assert_allclose(mean, rows[-1, :n].mean(axis=0), atol=1e-5)
    # Row 0 is the input embeddings themselves.
    with torch.inference_mode():
        ids = torch.tensor(prompt.token_ids, device=hot.runner.device)
        embeds = hot.runner.model.embed_tokens(ids)
    np.testing.assert_allclose(rows[0, :n], embeds.float().cpu().numpy(), atol=1e-6)


@pytest.mark.parametrize("extra", [0, 1, 7, 15])
def test_lengths_off_the_block_size(hot: LLMEngine, cold: LLMEngine, extra: int) -> None:
    """A repeat hits every full block but the one holding the last token; the partial tail
    (and that block) are computed, and every returned row is there."""
    ids = tuple(50 + (7 * i + 3 * extra) % 900 for i in range(5 * BS + extra))
    prompt = Prompt(ids)
    hidden(hot, f"len-warm-{extra}", prompt, "last")
    hit = assert_same(hot, cold, prompt, f"len-{extra}", max_tokens=3)
    assert hit == ((len(ids) - 1) // BS) * BS
    rows, _ = hidden(hot, f"len-rows-{extra}", prompt, "all", max_tokens=3)
    assert rows.shape[1] == len(ids) + 2


@pytest.mark.parametrize("shared_after", [True, False])
@pytest.mark.parametrize("pad", [0, 5, 11])
def test_image_prompts(hot: LLMEngine, cold: LLMEngine, pad: int, shared_after: bool) -> None:
    """With text shared after the image the hit covers the span; without, the match ends inside
    the span and is kept there (the rest of the span is computed from the encoder cache)."""
    image = png_bytes(seed=300 + pad)
    before = "Look" + " at this" * pad
    common = "Take your time and consider every part of the picture. " if shared_after else ""
    first = image_chat(hot, before, image, common + "What colour dominates?")
    second = image_chat(hot, before, image, common + "Describe the picture in detail.")
    (item,) = second.mm_items
    hidden(hot, f"img-warm-{pad}-{shared_after}", first, "last")
    hit = assert_same(hot, cold, second, f"img-{pad}-{shared_after}")
    matched = (shared_len(first, second) // BS) * BS
    inside = item.offset < matched < item.end
    assert inside == (not shared_after and pad < 11)  # pad 11 ends the match past the span
    assert hit == matched
    if shared_after:
        assert hit >= item.end


def test_hits_after_evictions(demo_model_dir: Path, cold: LLMEngine) -> None:
    """Blocks of a cached prompt are evicted (and reused by other prompts); a later prompt
    sharing its prefix hits what is left and recomputes the rest."""
    engine = make_engine(demo_model_dir, block_size=BS, num_blocks=20, hidden_state_layers=LAYERS)
    base = tuple(100 + (5 * i) % 700 for i in range(10 * BS))
    hidden(engine, "evict-a", Prompt(base), "last")
    engine.drain_events()
    for k in range(3):  # fresh prompts that need more blocks than are free
        other = tuple(800 + (11 * i + k) % 900 for i in range(5 * BS))
        hidden(engine, f"evict-other-{k}", Prompt(other), "last")
    removed = {
        key for e in engine.drain_events() if isinstance(e, BlockRemoved) for key in e.block_hashes
    }
    probe = Prompt((*base, 5, 6, 7))
    keys = block_keys(probe.token_ids, engine.namespace)[:10]
    evicted = [i for i, key in enumerate(keys) if key in removed]
    assert evicted, "no block of the cached prompt was evicted"
    hit = assert_same(engine, cold, probe, "evicted")
    assert hit == min(evicted) * BS > 0  # up to the first evicted block; the rest recomputed


def test_preempted_requests_return_the_same(demo_model_dir: Path, cold: LLMEngine) -> None:
    engine = make_engine(demo_model_dir, block_size=BS, num_blocks=12, hidden_state_layers=LAYERS)
    prompts = [
        Prompt(tuple(60 + (13 * i + 17 * r) % 800 for i in range(3 * BS + 5))) for r in range(3)
    ]
    for r, prompt in enumerate(prompts):
        engine.add_request(f"pre-{r}", prompt, params(40), hidden_states="all")
    outs = run_all(engine)
    assert engine.scheduler.counters.num_preemptions > 0
    for r, prompt in enumerate(prompts):
        expected, _ = hidden(cold, f"pre-cold-{r}", prompt, "all", max_tokens=40)
        np.testing.assert_allclose(
            outs[f"pre-{r}"][-1].hidden_states, expected, atol=1e-4, rtol=1e-4
        )


def test_last_needs_no_cache_and_the_rest_are_refused(
    demo_model_dir: Path, cold: LLMEngine
) -> None:
    engine = make_engine(demo_model_dir, block_size=BS)
    assert engine.runner.hidden_cache is None and engine.stats().hidden_cache_bytes == 0
    prompt = engine.renderer.render_completion(TEXT + "Only the last token.")
    hidden(engine, "nocache-warm", prompt, "last")
    got, hit = hidden(engine, "nocache-last", prompt, "last")
    expected, _ = hidden(cold, "nocache-last-cold", prompt, "last")
    assert hit > 0
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
    for pooling in ("mean", "all"):
        with pytest.raises(HiddenStatesUnavailable, match="--hidden-state-cache"):
            engine.add_request(f"nocache-{pooling}", prompt, params(), hidden_states=pooling)
    with pytest.raises(ValueError, match="pooling"):
        engine.add_request("nocache-bad", prompt, params(), hidden_states="max")
    assert not engine.has_unfinished_requests()


def test_abort_forgets_what_was_asked(hot: LLMEngine) -> None:
    prompt = hot.renderer.render_completion(TEXT + "Never mind.")
    hot.add_request("abort-last", prompt, params(), hidden_states="last")
    assert hot.runner.hidden.awaiting_last
    hot.abort_request("abort-last")
    assert not hot.runner.hidden.awaiting_last  # the step loop skips hidden-state work again


def test_counters(hot: LLMEngine) -> None:
    before = hot.stats()
    prompt = hot.renderer.render_completion(TEXT + "Count me.")
    _, first = hidden(hot, "count-1", prompt, "mean")
    _, second = hidden(hot, "count-2", prompt, "mean")
    after = hot.stats()
    assert after.hidden_queries_tokens - before.hidden_queries_tokens == 2 * len(prompt)
    assert after.hidden_hits_tokens - before.hidden_hits_tokens == first + second
    assert second == ((len(prompt) - 1) // BS) * BS
    assert after.hidden_cache_bytes == hot.runner.hidden_cache.nbytes > 0


def test_memory_budget_pays_for_the_hidden_states(demo_model_dir: Path) -> None:
    budget = 8 * 2**20
    plain = make_engine(
        demo_model_dir, block_size=BS, num_blocks=None, kv_cache_memory_bytes=budget
    )
    kept = make_engine(
        demo_model_dir,
        block_size=BS,
        num_blocks=None,
        kv_cache_memory_bytes=budget,
        hidden_state_layers=LAYERS,
    )
    info = kept.runner.info
    kv = info.kv_bytes_per_token() * BS
    hid = 3 * info.hidden_size * 4 * BS
    assert plain.runner.num_blocks == budget // kv - 1
    assert kept.runner.num_blocks == budget // (kv + hid) - 1
    total = kept.runner.kv_cache.nbytes + kept.runner.hidden_cache.nbytes
    assert total <= budget


@pytest.fixture(scope="module")
def tiny_llama_dir(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-llama-hidden")
    config = transformers.LlamaConfig(
        vocab_size=2000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir / name, path / name)
    return path


def test_layers_match_transformers(tiny_llama_dir: Path) -> None:
    """Kept rows are Hugging Face's hidden_states (inputs of layers 0 and 2, the final output),
    on a fresh prompt and on a prefix hit."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    engine = make_engine(tiny_llama_dir, block_size=BS, hidden_state_layers=(0, 2))
    ids = [(11 * i) % 1900 + 40 for i in range(3 * BS + 9)]
    with torch.no_grad():
        expected = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for attempt in range(2):
        rows, hit = hidden(engine, f"hf-{attempt}", Prompt(tuple(ids)), "all")
        assert hit == (3 * BS if attempt else 0)
        assert engine.runner.hidden.row_layers == (0, 2, 3)
        for row, layer in enumerate((0, 2, 3)):
            np.testing.assert_allclose(rows[row], expected[layer][0].numpy(), atol=1e-4, rtol=1e-4)
