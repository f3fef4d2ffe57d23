"""A worker's host-tier copy rate: seconds per prompt token copied back from its host memory
to the GPU (a host-tier hit), from its own metrics, with a prior until it has any.

vLLM's offloading connector counts the seconds its loads from the host tier took
(`vllm:kv_offload_load_time`, a counter) and the prompt tokens they served
(`vllm:prompt_tokens_by_source{source="external_kv_transfer"}`); kvgate's worker exports the
same two with `--kv-offload-bytes`. Their growth between polls is measured as the prefill rate
is (`PrefillRate`, prefill_rate.py: pooled until it covers `MIN_TOKENS`, then averaged).

Until a replica has copied that much, a host-tier token is priced at `PRIOR_RATIO` of a
computed one: the issue's H200 figures for kvgate's engine on the llama-1b shape, 8,000 tokens
prefilled in 57.4 ms against their 256 MB of KV copied from pinned host memory in 4.9 ms
(55 GB/s), 4.9 / 57.4 = 0.085. Not zero (a copy is not free, so a GPU hit still beats a host
hit) and far from a recompute (a host hit beats a cold replica).
"""

from __future__ import annotations

import contextlib

PRIOR_RATIO = 4.9 / 57.4  # copy seconds / prefill seconds per token, H200 llama-1b (above)

_LOAD_TIME = ("vllm:kv_offload_load_time_total", "vllm:kv_offload_load_time")
_SOURCE = "vllm:prompt_tokens_by_source_total"
_FROM_HOST = 'source="external_kv_transfer"'


def parse_copy_sums(text: str) -> tuple[float, float] | None:
    """(host-tier load seconds, prompt tokens loaded) summed over label sets; None when either
    is absent (no host tier there)."""
    seconds = tokens = 0.0
    seen = set()
    for line in text.splitlines():
        if not line.startswith(("vllm:kv_offload_load_time", _SOURCE)):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        with contextlib.suppress(ValueError, IndexError):
            value = float(line.rsplit(" ", 1)[1])
            if name in _LOAD_TIME:
                seconds += value
                seen.add("s")
            elif name == _SOURCE and _FROM_HOST in line:
                tokens += value
                seen.add("t")
    return (seconds, tokens) if len(seen) == 2 else None


def copy_seconds_per_token(measured: float | None, prefill: float) -> float:
    """The price of one host-tier token: the replica's measured copy rate, or the prior's share
    of `prefill`, the price of a computed token (in the same unit: seconds, or tokens while no
    prefill rate is measured, when a measured copy rate in seconds cannot be mixed in)."""
    return measured if measured is not None else PRIOR_RATIO * prefill
