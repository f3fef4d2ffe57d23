"""What the workers themselves say: counters scraped from each worker's /metrics, as deltas.

The benchmark figures of routers other than kvgate (SGLang's, vllm-router, guidellm through the
gateway) cannot rely on kvgate's response headers, so requests per replica and the token hit rate
come from the workers' own Prometheus counters, read before and after a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from harness.prom import samples

_SAMPLES = {
    "vllm:e2e_request_latency_seconds_count": "requests",
    "vllm:prefix_cache_queries_total": "queried_tokens",
    "vllm:prefix_cache_hits_total": "hit_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    # A KV connector's hits past the GPU's: vLLM's offloading connector's and kvgate's host tier.
    "vllm:external_prefix_cache_hits_total": "host_hit_tokens",
    # A first token's time at the worker (`first_token_parts`): the worker's TTFT from its HTTP
    # server's arrival, and the engine's intervals within it, as vLLM names them.
    "vllm:time_to_first_token_seconds_sum": "ttft_seconds",
    "vllm:time_to_first_token_seconds_count": "first_tokens",
    "vllm:request_queue_time_seconds_sum": "queue_seconds",
    "vllm:request_prefill_time_seconds_sum": "prefill_seconds",
    "vllm:request_prefill_time_seconds_count": "admitted",
}


@dataclass(slots=True)
class WorkerCounters:
    requests: float = 0.0
    queried_tokens: float = 0.0
    hit_tokens: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    host_hit_tokens: float = 0.0
    ttft_seconds: float = 0.0
    first_tokens: float = 0.0
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    admitted: float = 0.0

    def minus(self, before: WorkerCounters) -> WorkerCounters:
        return WorkerCounters(
            *(getattr(self, f) - getattr(before, f) for f in WorkerCounters.__slots__)
        )


def scrape(url: str, timeout: float = 10.0) -> WorkerCounters:
    text = httpx.get(f"{url}/metrics", timeout=timeout).text
    out = WorkerCounters()
    for name, _, value in samples(text):
        field = _SAMPLES.get(name)
        if field is not None:
            setattr(out, field, getattr(out, field) + value)
    return out


def scrape_all(urls: list[str]) -> dict[str, WorkerCounters]:
    return {u: scrape(u) for u in urls}


def deltas(
    before: dict[str, WorkerCounters], after: dict[str, WorkerCounters]
) -> dict[str, WorkerCounters]:
    return {u: after[u].minus(before[u]) for u in after}


def hit_rate(per_worker: dict[str, WorkerCounters]) -> float:
    """Prefix-cache hit tokens / looked-up tokens, summed over the workers."""
    queried = sum(c.queried_tokens for c in per_worker.values())
    return sum(c.hit_tokens for c in per_worker.values()) / queried if queried else 0.0


@dataclass(frozen=True, slots=True)
class FirstTokenParts:
    """Mean seconds of a first token at the workers: their TTFT (from the HTTP server's arrival
    to the first token out) and the engine's two intervals within it. What is left, `to_engine`,
    is the worker's time outside the engine: rendering, tokenizing, the way to the engine core
    and back, and the wait for the core to take the request in (between its steps)."""

    worker: float
    queue: float  # the engine's arrival to the request's admission to the running batch
    prefill: float  # admission to its first token

    @property
    def to_engine(self) -> float:
        return self.worker - self.queue - self.prefill


def first_token_parts(per_worker: dict[str, WorkerCounters]) -> FirstTokenParts | None:
    """The mean parts over every worker's requests; None where the workers timed none."""
    firsts = sum(c.first_tokens for c in per_worker.values())
    admitted = sum(c.admitted for c in per_worker.values())
    if not firsts or not admitted:
        return None
    total = {
        f: sum(getattr(c, f) for c in per_worker.values())
        for f in ("ttft_seconds", "queue_seconds", "prefill_seconds")
    }
    return FirstTokenParts(
        worker=total["ttft_seconds"] / firsts,
        queue=total["queue_seconds"] / admitted,
        prefill=total["prefill_seconds"] / admitted,
    )


def max_over_mean(counts: list[float]) -> float:
    """Load balance: the busiest replica's requests over the mean (1.0 = perfectly even).

    Replicas that served nothing count in the mean, so an idle replica shows as imbalance."""
    mean = sum(counts) / len(counts) if counts else 0.0
    return max(counts) / mean if mean else 0.0


def reset_prefix_caches(urls: list[str]) -> None:
    """Empty every worker's prefix cache (workers publish AllBlocksCleared to the gateway)."""
    for u in urls:
        r = httpx.post(f"{u}/reset_prefix_cache", timeout=30.0)
        r.raise_for_status()
        if not r.json().get("reset", False):
            raise RuntimeError(f"{u} refused to reset its prefix cache (requests in flight?)")
