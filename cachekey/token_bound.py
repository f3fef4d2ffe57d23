"""A proven lower bound on the tokens a text encodes to, read from the tokenizer's definition.

A prompt far past the context costs its whole tokenization before its 400 (a 12 MB chat: 30 s of
CPU). When the text's length alone proves it too long, the prompt is refused without it.

The bound: if no token ever covers more than `C` characters of the text, a text of `n`
characters needs at least ceil(n / C) tokens. `chars_per_token_bound` returns such a `C`, the
longest string in the vocabulary and the added tokens, only when the tokenizer's definition
proves the premise; otherwise None (no bound: every prompt is tokenized, as before):

- its normalizer never shortens a text: Prepend, Replace of a string by one at least as long,
  Lowercase, NFD, NFKD (each maps a character to one or more), or a Sequence of those; none at
  all. (NFC, NFKC, Strip, StripAccents, BERT's and SentencePiece's precompiled map can shorten.)
- its pre-tokenizer never drops a character: ByteLevel, Metaspace, Digits, UnicodeScripts,
  Split and Punctuation unless their behavior is "removed", or a Sequence of those; none.
  (Whitespace, WhitespaceSplit and BERT's drop the whitespace.)
- its model covers each character with vocabulary strings, each string character standing for
  at most one normalized character: BPE whose unknown characters become bytes (byte_fallback),
  one unknown token each (not fuse_unk), or cannot occur (ByteLevel: the 256 byte characters
  are all in the vocabulary); Unigram with byte_fallback. (WordPiece's unknown token stands for
  a whole word, a fused unknown for a whole run: no bound.)
- no added token strips the whitespace around it (lstrip, rstrip), and no truncation is set.

Byte-level vocabulary strings hold one character per byte, and a byte-fallback token (`<0x41>`)
covers one byte: both cover at most as many characters as they have.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer, pre_tokenizers

_GROWING_NORMALIZERS = frozenset({"Prepend", "Lowercase", "NFD", "NFKD"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})


def chars_per_token_bound(tok: Tokenizer) -> int | None:
    """The most characters of a text one token can cover, when the definition proves it."""
    if tok.truncation is not None:
        return None
    spec = json.loads(tok.to_str())
    if not _never_shortens(spec.get("normalizer")):
        return None
    pre = spec.get("pre_tokenizer")
    if not _never_drops(pre):
        return None
    model = spec.get("model") or {}
    if not _covers_every_character(model, _uses_byte_level(pre)):
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    strings = _vocab_strings(model)
    longest = max((len(s) for s in strings), default=0)
    longest = max([longest, *(len(a["content"]) for a in added)])
    return longest if longest > 0 else None


def min_tokens(chars: int, bound: int | None) -> int:
    """The fewest tokens a text of `chars` characters can encode to (0 without a bound)."""
    return 0 if bound is None else -(-chars // bound)


def _never_shortens(norm: dict[str, Any] | None) -> bool:
    if norm is None:
        return True
    kind = norm.get("type")
    if kind == "Sequence":
        return all(_never_shortens(n) for n in norm.get("normalizers", []))
    if kind == "Replace":
        pattern = norm.get("pattern") or {}
        return "String" in pattern and len(norm.get("content", "")) >= len(pattern["String"])
    return kind in _GROWING_NORMALIZERS


def _never_drops(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_never_drops(p) for p in pre.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return str(pre.get("behavior", "")).lower() != "removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _uses_byte_level(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_uses_byte_level(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") == "ByteLevel"


def _covers_every_character(model: dict[str, Any], byte_level: bool) -> bool:
    kind = model.get("type")
    if kind == "Unigram":
        return bool(model.get("byte_fallback"))
    if kind != "BPE":
        return False
    if model.get("byte_fallback"):
        return True
    if model.get("unk_token") is not None and not model.get("fuse_unk"):
        return True
    # Byte-level: every text is bytes, each mapped to one of 256 characters, all in the vocab.
    return byte_level and set(pre_tokenizers.ByteLevel.alphabet()) <= set(_vocab_strings(model))


def _vocab_strings(model: dict[str, Any]) -> list[str]:
    vocab = model.get("vocab") or {}
    if isinstance(vocab, dict):
        return list(vocab)
    return [piece for piece, _score in vocab]  # Unigram: [piece, score] pairs
