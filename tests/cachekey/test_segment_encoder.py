"""The segment-cached encoder equals one plain `tokenizer.encode(text)` on every input."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from cachekey import ModelAssets
from cachekey.segment_encoder import SegmentEncoder

CORPUS = [
    "The gateway routes each request to the replica holding the longest cached prefix.",
    "Blocks of sixteen tokens are hashed with their parent, so a key names a whole prefix.",
    "Ünïcödé text, numbers 12345 and CAPITALS mix with tabs\tand newlines\n here.",
] * 20


@functools.cache
def byte_level_with_normalizer() -> Tokenizer:
    """Byte-level BPE behind an NFKC normalizer, prefix space, and added tokens of every kind."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_tokens([AddedToken("<tool_call>", normalized=True), AddedToken("ﬁx", normalized=True)])
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True), AddedToken("<pad>", rstrip=True)])
    return tok


def metaspace_first() -> Tokenizer:
    """SentencePiece-like: the prefix '▁' goes on the first split only, so splitting must not."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model_dir: Path) -> Tokenizer:
    return ModelAssets.from_dir(demo_model_dir).tokenizer


def pieces(specials: list[str]) -> st.SearchStrategy[str]:
    atoms = st.sampled_from(
        [*specials, " ", "  ", "\n", "\t", "hello", " world", "Cache", "é", "漢字", "12", "!?", "ﬁ"]
    )
    return st.lists(st.one_of(atoms, st.text(max_size=6)), max_size=25).map("".join)


def assert_same_on(tok: Tokenizer, texts: list[str]) -> SegmentEncoder:
    enc = SegmentEncoder(tok, max_entries=64, max_chars=10_000)
    for text in texts * 2:  # the second pass is served from the cache
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False).ids, repr(text)
    return enc


DEMO_SPECIALS = ["<s>", "</s>", "<image>", "<|im_start|>", "<|im_end|>", "<unk>"]


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(pieces(DEMO_SPECIALS), min_size=1, max_size=4))
def test_demo_tokenizer_equivalence(demo_tokenizer, texts):
    assert_same_on(demo_tokenizer, texts)


OTHER_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "<mask>", "<pad>"]


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(pieces(OTHER_SPECIALS), min_size=1, max_size=4))
def test_normalized_byte_level_equivalence(texts):
    tok = byte_level_with_normalizer()
    enc = assert_same_on(tok, texts)
    assert enc.splits  # it splits at the verbatim special tokens, and still agrees


def test_metaspace_first_falls_back_and_stays_exact():
    tok = metaspace_first()
    tok.add_special_tokens(["<|im_end|>"])
    texts = ["a<|im_end|>b", "hello<|im_end|> world", "<|im_end|>x y"]
    enc = assert_same_on(tok, texts)
    assert not enc.splits


def test_shared_system_prompt_is_tokenized_once(demo_tokenizer):
    enc = SegmentEncoder(demo_tokenizer, max_entries=64, max_chars=1_000_000)
    system = "You are a helpful assistant for the routing team. " * 200
    first = f"<s><|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    second = first.replace("user\nhi", "user\nanother question")
    enc.encode(first)
    misses = enc.misses
    assert enc.encode(second) == demo_tokenizer.encode(second, add_special_tokens=False).ids
    assert enc.misses == misses + 1  # only the new user text was tokenized
    assert enc.hits >= 3  # "\n" pieces and the long system prompt came from the cache


def test_cache_is_bounded_by_entries_and_chars(demo_tokenizer):
    enc = SegmentEncoder(demo_tokenizer, max_entries=2, max_chars=50)
    for word in ("alpha", "beta", "gamma", "delta"):
        enc.encode(f"{word}<s>")
    assert len(enc._cache) == 2
    enc.encode("x" * 60)  # larger than the whole budget: encoded, not cached
    assert "x" * 60 not in enc._cache and enc._chars <= 50
