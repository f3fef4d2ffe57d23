"""Sampler, detokenizer, parameter validation and admission checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachekey import MMItem, Prompt
from cachekey.assets import ModelAssets
from cachekey.errors import RenderError
from tests.support.engine import generate, make_engine, run_all, tokens
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.sampler import Sampler
from worker.engine.sampling_params import SamplingParams


def test_sampling_params_validation() -> None:
    for bad in (
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_k": 0},
        {"max_tokens": 0},
        {"stop": ("",)},
        {"stop_token_ids": (-3,)},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    assert SamplingParams(stop="END").stop == ("END",)  # type: ignore[arg-type]


def test_engine_config_validation() -> None:
    with pytest.raises(ValueError, match="engine"):
        EngineConfig(model="m", engine="jax")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model="m", block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        EngineConfig(model="m", num_blocks=0)
    assert EngineConfig(model="/models/tiny-llama").served_model_name == "tiny-llama"


def test_sampler_modes() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.9]])
    greedy = SamplingParams(temperature=0.0)
    assert sampler.sample(logits, [("a", greedy), ("b", greedy)]) == [1, 0]
    top1 = SamplingParams(temperature=1.0, top_k=1)
    tiny_p = SamplingParams(temperature=1.0, top_p=0.01)
    assert sampler.sample(logits, [("c", top1), ("d", tiny_p)]) == [1, 0]
    # top_k=2 never picks outside the two best tokens.
    k2 = [sampler.sample(logits[:1], [(f"k{i}", SamplingParams(top_k=2))])[0] for i in range(50)]
    assert set(k2) <= {1, 3} and len(set(k2)) == 2


def test_seeded_sampling_is_reproducible_regardless_of_batch() -> None:
    flat = torch.zeros((3, 64))
    seeded = SamplingParams(temperature=1.0, seed=7)
    alone = Sampler(torch.device("cpu"))
    together = Sampler(torch.device("cpu"))
    solo = [alone.sample(flat[:1], [("x", seeded)])[0] for _ in range(10)]
    mixed = []
    for i in range(10):
        batch = [("y", SamplingParams()), ("x", seeded), (f"z{i}", SamplingParams(seed=i))]
        mixed.append(together.sample(flat, batch)[1])
    assert solo == mixed and len(set(solo)) > 1


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path):  # type: ignore[no-untyped-def]
    return ModelAssets.from_dir(demo_model_dir).tokenizer


def test_detokenizer_streams_the_same_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "Hello world, these are streamed words: naïve café ünïcode."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, [], ())
    pieces = []
    for t in ids:
        detok.add_tokens([t])
        pieces.append(detok.take_delta(finished=False))
    pieces.append(detok.take_delta(finished=True))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_stop_string_and_holdback(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("one two three STOP four", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, [], ("STOP", "two threeX"))
    streamed, stopped = "", False
    for t in ids:
        stopped = detok.add_tokens([t])
        streamed += detok.take_delta(finished=stopped)
        if stopped:
            break
        # Never hand out text that could still turn into a stop string.
        assert not streamed.endswith(("S", "ST", "STO", "two", "two three"))
    assert stopped and streamed.rstrip() == "one two three"


def test_engine_stop_strings_and_seeds(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir, block_size=16)
    prompt = engine.renderer.render_completion("Tell me a story about a brave knight.")
    free = generate(engine, "free", prompt, SamplingParams(temperature=0.0, max_tokens=12))
    text = "".join(o.text_delta for o in free)
    assert text, "the demo model produced no text"
    stop = text[len(text) // 2 : len(text) // 2 + 3].strip() or text[:1]
    cut = generate(
        engine, "cut", prompt, SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,))
    )
    assert cut[-1].finish_reason == "stop"
    assert "".join(o.text_delta for o in cut) == text[: text.index(stop)]
    first_token = tokens(free)[0]
    by_id = generate(
        engine, "tid", prompt, SamplingParams(temperature=0.0, stop_token_ids=(first_token,))
    )
    assert by_id[-1].finish_reason == "stop" and by_id[-1].num_output_tokens == 1
    params = SamplingParams(temperature=1.0, seed=123, max_tokens=10)
    a = generate(engine, "s1", prompt, params)
    engine.add_request("s2", prompt, params)
    engine.add_request("other", prompt, SamplingParams(temperature=1.0, max_tokens=10))
    b = run_all(engine)["s2"]
    assert tokens(a) == tokens(b)


def test_bad_requests_fail_alone(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir, engine="sim", max_model_len=64)
    ok = Prompt((1, 5, 6, 7))
    image = engine.assets.image
    assert image is not None
    ph = image.image_token_id
    bad = [
        Prompt(()),
        Prompt(tuple(range(10, 80))),  # longer than max_model_len
        Prompt((1, 5, 10**6)),  # outside the vocabulary
        Prompt((1,) + (ph,) * 4, (MMItem("x", "image", 1, 4),)),  # wrong span length
        Prompt((1, 2, 3), (MMItem("x", "audio", 1, 1),)),
        Prompt((1, ph, 2)),  # placeholder without an image
    ]
    for prompt in bad:
        with pytest.raises(RenderError):
            engine.add_request("bad", prompt, SamplingParams())
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", ok, SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("ok", ok, SamplingParams())
    assert run_all(engine)["ok"][-1].num_output_tokens == 3


def test_torch_engine_rejects_undecodable_image(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir)
    image = engine.assets.image
    assert image is not None
    span = (image.image_token_id,) * image.tokens_per_image
    prompt = Prompt((1, *span, 9), (MMItem("junk", "image", 1, len(span)),), {"junk": b"no"})
    with pytest.raises(RenderError):
        engine.add_request("junk", prompt, SamplingParams())
    assert not engine.has_unfinished_requests()


def test_generated_placeholder_id_is_plain_text(demo_model_dir: Path) -> None:
    """A model may sample the image placeholder id; decoding it must not look for an image."""
    engine = make_engine(demo_model_dir)
    image = engine.assets.image
    assert image is not None
    prompt = engine.renderer.render_completion("Say something")
    engine.add_request("ph", prompt, SamplingParams(temperature=0.0, max_tokens=4))
    assert engine.step()  # prefill + first token
    seq = engine._seqs["ph"]
    seq.token_ids[-1] = image.image_token_id  # as if the model had sampled it
    outs = run_all(engine)["ph"]
    assert outs[-1].finished and outs[-1].num_output_tokens == 4
