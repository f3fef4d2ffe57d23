"""Tokenization memoized per segment between added tokens, equal to one plain encode.

Hugging Face tokenizers first cut the text at added tokens (`<|im_start|>`, `<image>`, ...) and
encode each piece on its own, so caching the ids of each piece is exact. A long system prompt shared
by many requests is then tokenized once.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

from tokenizers import Tokenizer


class SegmentEncoder:
    """tokenizer.encode(text, add_special_tokens=False).ids, memoized per added-token segment.

    Splitting is only used for added tokens the tokenizer matches verbatim (no lstrip/rstrip/
    single_word, and not subject to a normalizer), and only after a self-check on probe strings
    agrees with the plain encode; otherwise every call is a plain encode.
    """

    def __init__(self, tokenizer: Tokenizer, max_entries: int, max_chars: int) -> None:
        self._tok = tokenizer
        self._max_entries, self._max_chars = max_entries, max_chars
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self.hits = self.misses = 0  # segment lookups, for benchmarks and metrics
        self._lock = threading.Lock()
        self._ids: dict[str, int] = {}
        for tid, added in tokenizer.get_added_tokens_decoder().items():
            verbatim = not (added.lstrip or added.rstrip or added.single_word)
            if verbatim and (not added.normalized or tokenizer.normalizer is None):
                self._ids[added.content] = tid
        self._split: re.Pattern[str] | None = None
        if self._ids and max_entries > 0:
            alternatives = sorted(self._ids, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
            if not self._agrees_on_probes():
                self._split = None

    def _agrees_on_probes(self) -> bool:
        for token in self._ids:
            probe = f"a{token}b {token} c{token}{token}\nd  é{token}"
            if self.encode(probe) != self._tok.encode(probe, add_special_tokens=False).ids:
                return False
        self.clear()
        return True

    @property
    def splits(self) -> bool:
        """Whether encoding goes through the segment cache (False: plain encodes)."""
        return self._split is not None

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._chars = 0
            self.hits = self.misses = 0

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._tok.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        # re.split with one group alternates: text, token, text, token, ..., text.
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:
                ids.append(self._ids[piece])
            elif piece:
                ids.extend(self._segment(piece))
        return ids

    def _segment(self, text: str) -> tuple[int, ...]:
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return hit
            self.misses += 1
        ids = tuple(self._tok.encode(text, add_special_tokens=False).ids)
        if len(text) > self._max_chars:
            return ids
        with self._lock:
            if text not in self._cache:
                self._cache[text] = ids
                self._chars += len(text)
            while len(self._cache) > self._max_entries or self._chars > self._max_chars:
                old, _ = self._cache.popitem(last=False)
                self._chars -= len(old)
        return ids
