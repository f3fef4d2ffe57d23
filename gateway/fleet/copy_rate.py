"""A worker's host-tier copy rate: seconds per prompt token copied back from its host memory
to the GPU (a host-tier hit), from its own metrics, with a prior until it has any.

vLLM's offloading connector counts the seconds its copies from the host tier took
(`vllm:kv_offload_load_time`, or its older `vllm:kv_offload_total_time{transfer_type=
"CPU_to_GPU"}`) and the prompt tokens they served (`vllm:external_prefix_cache_hits`); a worker
that exports both gets its own rate. kvgate's worker exports the newer name: on the CPU the
plain copies' time, in the sim engine the time it charges them (worker/server/tier_metrics.py).
Their growth between polls is measured as the prefill rate is (`PrefillRate`, prefill_rate.py:
pooled until it covers `MIN_TOKENS`, then averaged).

Until a replica has copied that much, a host-tier token is priced at `PRIOR_RATIO` of a
computed one: the issue's H200 figures for kvgate's engine on the llama-1b shape, 8,000 tokens
prefilled in 57.4 ms against their 256 MB of KV copied from pinned host memory in 4.9 ms
(55 GB/s), 4.9 / 57.4 = 0.085. Not zero (a copy is not free, so a GPU hit still beats a host
hit) and far from a recompute (a host hit beats a cold replica).
"""

from __future__ import annotations

import contextlib

PRIOR_RATIO = 4.9 / 57.4  # copy seconds / prefill seconds per token, H200 llama-1b (above)

_SECONDS = ("vllm:kv_offload_load_time", "vllm:kv_offload_total_time")
_TOKENS = "vllm:external_prefix_cache_hits"
_LOADS = 'transfer_type="CPU_to_GPU"'  # the older family counts both directions
_SLOT = {_SECONDS[0]: 0, _SECONDS[1]: 1, _TOKENS: 2}


def parse_copy_sums(text: str) -> tuple[float, float] | None:
    """(host-tier load seconds, prompt tokens loaded) summed over label sets; None when either
    is absent (no host tier there, or no load time exported). vLLM 0.32 exports both families
    of the seconds from the same counts: the newer is taken alone then, not added twice."""
    sums = [0.0, 0.0, 0.0]  # the newer family's seconds, the older's, tokens
    seen = set()
    for line in text.splitlines():
        if not line.startswith(("vllm:kv_offload_", _TOKENS)):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name == _SECONDS[1] and _LOADS not in line:
            continue
        i = _SLOT.get(name)
        if i is not None:
            with contextlib.suppress(ValueError, IndexError):
                sums[i] += float(line.rsplit(" ", 1)[1])
                seen.add(i)
    if 2 not in seen or not seen & {0, 1}:
        return None
    return (sums[0] if 0 in seen else sums[1]), sums[2]


def copy_seconds_per_token(measured: float | None, prefill: float) -> float:
    """The price of one host-tier token: the replica's measured copy rate, or the prior's share
    of `prefill`, the price of a computed token (in the same unit: seconds, or tokens while no
    prefill rate is measured, when a measured copy rate in seconds cannot be mixed in)."""
    return measured if measured is not None else PRIOR_RATIO * prefill
