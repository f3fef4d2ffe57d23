"""Incremental detokenization with stop strings, for streaming.

Each new token is decoded together with a few previous ones (tokenizers merge spaces and
byte-level pieces across tokens); text is emitted only once it is complete UTF-8. Text that
could be the start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Previous tokens decoded along with a new one: enough for byte-fallback and space merging.
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self._sent = 0

    def add_tokens(self, token_ids: Sequence[int]) -> bool:
        """Append tokens; True when a stop string appeared (the text is cut before it)."""
        old_len = len(self.text)
        for token_id in token_ids:
            self._add(token_id)
        if not self._stop:
            return False
        start = max(0, old_len - self._max_stop + 1)
        found = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if not found:
            return False
        self.text = self.text[: min(found)]
        return True

    def _add(self, token_id: int) -> None:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            if self._prefix_offset > 4 * _CONTEXT_TOKENS:
                # Keep the window small: old tokens no longer influence new text.
                del self._ids[: self._prefix_offset]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while streaming, a possible stop-string prefix stays back."""
        end = len(self.text) if finished else len(self.text) - self._held_back()
        if end <= self._sent:
            return ""
        delta = self.text[self._sent : end]
        self._sent = end
        return delta

    def _held_back(self) -> int:
        for k in range(min(self._max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
