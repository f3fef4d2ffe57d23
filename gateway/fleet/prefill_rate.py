"""A worker's measured prefill rate: seconds per prompt token it computes, from its own metrics.

vLLM (and the kvgate worker) record per request, at its first token, the prefill interval
(`vllm:request_prefill_time_seconds`: from its latest admission to its first token) and the
prompt tokens it computed (`vllm:request_prefill_kv_computed_tokens`: prefix-cache hits
excluded). Between two polls the growth of the two histograms' sums is the seconds and tokens
of the prefills that finished in between; their ratio is the rate. Polls are pooled until they
cover `MIN_TOKENS`, then folded into a moving average, so one short request cannot swing it.

The interval of a prefill that shared its engine steps with other prefills includes their work
too, so under load the rate reads high on every replica alike (docs/gateway.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

_SECONDS = "vllm:request_prefill_time_seconds_sum"
_TOKENS = "vllm:request_prefill_kv_computed_tokens_sum"
MIN_TOKENS = 1024  # tokens a measurement must cover
SMOOTHING = 0.3  # weight of the newest measurement


def parse_prefill_sums(text: str) -> tuple[float, float] | None:
    """(prefill seconds, computed tokens) summed over label sets; None when either is absent."""
    sums = {_SECONDS: 0.0, _TOKENS: 0.0}
    seen = set()
    for line in text.splitlines():
        if not line.startswith("vllm:request_prefill_"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            with contextlib.suppress(ValueError, IndexError):
                sums[name] += float(line.rsplit(" ", 1)[1])
                seen.add(name)
    return (sums[_SECONDS], sums[_TOKENS]) if len(seen) == 2 else None


@dataclass(slots=True)
class PrefillRate:
    seconds_per_token: float | None = None  # None until measured
    _base: tuple[float, float] | None = None  # the sums where the pending window starts

    def observe(self, sums: tuple[float, float] | None) -> None:
        if sums is None:
            return
        base = self._base
        if base is None or sums[0] < base[0] or sums[1] < base[1]:
            self._base = sums  # first poll, or the worker restarted: a new baseline
            return
        seconds, tokens = sums[0] - base[0], sums[1] - base[1]
        if tokens < MIN_TOKENS:
            return  # keep pooling
        rate = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else old + SMOOTHING * (rate - old)
        self._base = sums

    def reset(self) -> None:
        self.seconds_per_token, self._base = None, None
