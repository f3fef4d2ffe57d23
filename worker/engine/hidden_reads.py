"""HiddenReads: which requests want hidden states back, and reading them out.

A request asks for one of three poolings:

- `last`: the final hidden state of the last prompt token, shape [hidden]. That token is always
  computed (a prefix hit never covers it), so its row is taken from the step that completes the
  prompt and no hidden-state cache is needed.
- `mean`: the mean of the final hidden states of all prompt tokens, shape [hidden].
- `all`: every kept row (chosen layers, then the final one) of every token the model ran for
  the request, prompt and generated (the last sampled token never ran), [rows, tokens, hidden].

`mean` and `all` read tokens that a prefix hit skipped, so they need the HiddenStateCache; they are
read when the request finishes, while it still holds its blocks. Nothing here runs in a step
unless a live request asked for `last` (one counter test otherwise). No torch here: the sim
engine uses this too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from worker.engine.sequence import Sequence

if TYPE_CHECKING:
    from torch import Tensor

    from worker.engine.hidden_cache import HiddenStateCache
    from worker.engine.scheduler import ScheduledSeq

POOLINGS = ("last", "mean", "all")
NEEDS_CACHE = frozenset({"mean", "all"})


class HiddenStatesUnavailable(ValueError):
    """A request wants hidden states of tokens this engine does not keep."""


@dataclass(slots=True)
class HiddenCounters:
    """Prompt tokens of requests that wanted hidden states, and how many came from the cache."""

    queries_tokens: int = 0
    hits_tokens: int = 0


def check_pooling(pooling: str, has_cache: bool) -> None:
    if pooling not in POOLINGS:
        raise ValueError(f"hidden-state pooling must be one of {', '.join(POOLINGS)}")
    if pooling in NEEDS_CACHE and not has_cache:
        raise HiddenStatesUnavailable(
            f"{pooling!r} hidden states need every prompt token's hidden state: start the "
            "worker with --hidden-state-cache"
        )


class HiddenReads:
    def __init__(self, cache: HiddenStateCache | None) -> None:
        self.cache = cache
        self.counters = HiddenCounters()
        self._wanted: dict[str, str] = {}
        self._last: dict[str, np.ndarray] = {}
        self._awaiting_last = 0  # `last` requests whose row is not taken yet

    @property
    def has_cache(self) -> bool:
        return self.cache is not None

    @property
    def row_layers(self) -> tuple[int, ...]:
        """Hugging Face hidden_states index of each row `all` returns; () without the cache."""
        return self.cache.row_layers if self.cache is not None else ()

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes if self.cache is not None else 0

    def check(self, pooling: str) -> None:
        check_pooling(pooling, self.has_cache)

    def want(self, request_id: str, pooling: str) -> None:
        self.check(pooling)
        self._wanted[request_id] = pooling
        self._awaiting_last += pooling == "last"

    @property
    def awaiting_last(self) -> bool:
        return self._awaiting_last > 0

    def capture_last(self, batch: list[ScheduledSeq], sampling: list[int], hidden: Tensor) -> None:
        """Keep the final hidden state of the last prompt token of `last` requests.

        `hidden` holds the rows of the sampling sequences, in the order of `sampling`.
        """
        for row, index in enumerate(sampling):
            seq = batch[index].seq
            rid = seq.request_id
            if seq.num_output_tokens or rid in self._last or self._wanted.get(rid) != "last":
                continue  # a recompute after preemption: the first row was kept
            self._last[rid] = hidden[row].float().cpu().numpy()
            self._awaiting_last -= 1

    def take(self, seq: Sequence) -> np.ndarray | None:
        """The request's hidden states, if it asked for any (call before its blocks are freed)."""
        pooling = self._wanted.pop(seq.request_id, None)
        if pooling is None:
            return None
        self.counters.queries_tokens += seq.num_prompt_tokens
        self.counters.hits_tokens += seq.num_cached_tokens or 0
        return self.read(seq, pooling)

    def read(self, seq: Sequence, pooling: str) -> np.ndarray:
        if pooling == "last":
            return self._last.pop(seq.request_id)
        assert self.cache is not None
        if pooling == "mean":
            rows = self.cache.read(seq.block_table, seq.num_prompt_tokens, final_only=True)
            return rows.mean(axis=0, dtype=np.float64).astype(np.float32)
        return self.cache.read(seq.block_table, seq.num_computed_tokens)

    def forget(self, request_id: str) -> None:
        """An aborted (or finished) request: drop what it asked for."""
        pooling = self._wanted.pop(request_id, None)
        captured = self._last.pop(request_id, None)
        if pooling == "last" and captured is None:
            self._awaiting_last -= 1
