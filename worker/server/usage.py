"""A completion's `usage`, as vLLM's; a worker with a host KV tier adds one kvgate-only field.

`prompt_tokens_details.cpu_cached_tokens` is the part of `cached_tokens` copied back from the
host tier rather than found on the GPU (the gateway predicts the two parts apart:
`x-kvgate-predicted-gpu-cached-tokens`, `x-kvgate-predicted-cpu-cached-tokens`). It is in the
body, not a header, because a streamed response's headers leave before the request is admitted;
a worker without the tier leaves it out, so its usage is vLLM's exactly.
"""

from __future__ import annotations

from worker.engine.outputs import RequestOutput


def cached_parts(out: RequestOutput) -> tuple[int, int | None]:
    return out.num_cached_tokens, out.num_host_cached_tokens


def usage_of(prompt_tokens: int, completion_tokens: int, cached: tuple[int, int | None]) -> dict:
    """vLLM's usage; a worker with a host KV tier adds `cpu_cached_tokens` (kvgate's own): the
    part of `cached_tokens` copied back from that tier rather than found on the GPU."""
    details: dict[str, int] = {"cached_tokens": cached[0]}
    if cached[1] is not None:
        details["cpu_cached_tokens"] = cached[1]
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }
