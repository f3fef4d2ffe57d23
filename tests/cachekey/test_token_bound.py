"""Refusing hopeless prompts by their length (cachekey/token_bound.py), with real tokenizers.

The bound must be proven, not guessed: hypothesis searches texts for one that encodes to fewer
tokens than the bound says (for the demo model's byte-level BPE and a SentencePiece-style BPE
with byte fallback), tokenizers whose definitions do not prove it get no bound, and a renderer
that refuses early answers 2,000 fuzzed chats exactly as one that tokenizes everything.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

from cachekey import ModelAssets, Renderer
from cachekey.errors import PromptTooLongError, RenderError
from cachekey.render import RenderLimits
from cachekey.token_bound import chars_per_token_bound, min_tokens
from worker.demo.model import ensure_demo_model

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Caches keep the prefix of a prompt; routing follows them.",
    "naïve café – 東京 🙂 tabs\tand\nnewlines  double  spaces",
    "def f(x):\n    return x * 2  # code, too\n",
]


@pytest.fixture(scope="module")
def demo() -> ModelAssets:
    return ModelAssets.from_dir(ensure_demo_model())


def sentencepiece_like() -> Tokenizer:
    """Llama 2's shape: ▁ for spaces (normalizer), no pre-tokenizer, BPE with byte fallback."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


SP = sentencepiece_like()
TEXTS = st.text(max_size=300) | st.text(alphabet=" \t\nx▁é🙂<>s/", max_size=300)


def test_the_demo_tokenizer_and_a_sentencepiece_like_one_have_a_bound(demo) -> None:
    assert chars_per_token_bound(demo.tokenizer) == max(
        len(s) for s in demo.tokenizer.get_vocab(with_added_tokens=True)
    )
    assert chars_per_token_bound(SP) is not None


@pytest.fixture(scope="module")
def bounded(demo) -> list[tuple[Tokenizer, int | None]]:
    return [(tok, chars_per_token_bound(tok)) for tok in (demo.tokenizer, SP)]


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS)
def test_no_text_encodes_to_fewer_tokens_than_the_bound(bounded, text: str) -> None:
    for tok, bound in bounded:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) >= min_tokens(len(text), bound), (text, ids)


def _with(tok: Tokenizer, **changes) -> Tokenizer:
    copy = Tokenizer.from_str(tok.to_str())
    for name, value in changes.items():
        setattr(copy, name, value)
    return copy


def test_tokenizers_whose_definition_proves_nothing_get_no_bound() -> None:
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    fused = Tokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True))
    stripping = Tokenizer.from_str(SP.to_str())
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    truncating = Tokenizer.from_str(SP.to_str())
    truncating.enable_truncation(16)
    unproven = {
        "WordPiece (an unknown word is one token)": wordpiece,
        "a fused unknown token": fused,
        "NFKC (shortens)": _with(SP, normalizer=normalizers.NFKC()),
        "Strip (shortens)": _with(SP, normalizer=normalizers.Strip()),
        "Replace by a shorter string": _with(SP, normalizer=normalizers.Replace("  ", " ")),
        "Whitespace (drops spaces)": _with(SP, pre_tokenizer=pre_tokenizers.Whitespace()),
        "Split, removed": _with(SP, pre_tokenizer=pre_tokenizers.Split(" ", "removed")),
        "an added token that strips": stripping,
        "truncation": truncating,
    }
    for what, tok in unproven.items():
        assert chars_per_token_bound(tok) is None, what


def test_a_12_mb_chat_is_refused_in_well_under_a_second(demo) -> None:
    r = Renderer(demo)
    t0 = time.perf_counter()
    with pytest.raises(PromptTooLongError) as e:
        r.render_chat([{"role": "user", "content": "x " * 6_000_000}])
    took = time.perf_counter() - t0
    print(f"12 MB chat refused in {took * 1000:.0f} ms: {e.value.message}")
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert "at least" in e.value.message and took < 1.0


MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]), "content": TEXTS}
    ),
    min_size=1,
    max_size=4,
)


def _answer(render, renderer: Renderer, arg: object) -> object:
    """A render's result, or its error as the client sees it (status, code, param)."""
    try:
        return render(renderer, arg)
    except RenderError as e:
        return (type(e).__name__, e.status_code, e.code, e.param)


@pytest.fixture(scope="module")
def renderers(demo) -> dict[int, tuple[Renderer, Renderer]]:
    """Per context limit: a renderer that refuses early, and one as it was (tokenizes all)."""
    pairs = {}
    for limit in range(1, 65):
        early = Renderer(demo, limits=RenderLimits(max_model_len=limit))
        full = Renderer(demo, limits=RenderLimits(max_model_len=limit))
        full._max_chars = None
        pairs[limit] = (early, full)
    return pairs


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=MESSAGES, prompt=TEXTS, limit=st.integers(1, 64))
def test_refusing_early_answers_2000_fuzzed_bodies_as_tokenizing_all_does(
    renderers, messages: list, prompt: str, limit: int
) -> None:
    early, full = renderers[limit]
    for method, arg in ((Renderer.render_chat, messages), (Renderer.render_completion, prompt)):
        assert _answer(method, early, arg) == _answer(method, full, arg)
