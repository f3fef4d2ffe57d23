"""Prometheus metrics with vLLM's names, on a registry owned by one app (never the global one).

Engine-side numbers (queues, KV usage, cumulative token counters) are read from the stats the
engine core last sent, at scrape time; request latencies are observed by the handlers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from worker.engine.llm_engine import EngineStats, RequestOutput
from worker.engine.outputs import LoRAStats
from worker.server.tier_metrics import tier_metrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
)
# vLLM's 1-2-5 token buckets.
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))


class _EngineCollector(Collector):
    """Each engine's numbers, labelled `engine` with its data-parallel rank, as vLLM labels them
    (a gateway reads each rank's load from that label)."""

    def __init__(
        self,
        engines: list[tuple[str, Callable[[], EngineStats]]],
        model_name: str,
        info: dict[str, str],
    ):
        self._engines = engines
        self._model = model_name
        self._info = info

    def collect(self) -> Iterator:
        labels = ["model_name", "engine"]
        stats = [([self._model, engine], read()) for engine, read in self._engines]
        for kind, name, doc, field in _STATS_METRICS:
            family = kind(name, doc, labels=labels)
            for values, s in stats:
                family.add_metric(values, getattr(s, field))
            yield family
        yield from tier_metrics(stats)
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "KV-cache configuration.", labels=[*self._info, "engine"]
        )
        for engine, _ in self._engines:
            info.add_metric([*self._info.values(), engine], 1.0)
        yield info
        loras = [(values, s.lora) for values, s in stats if s.lora is not None]
        if loras:
            yield from _lora_metrics(loras)


_G, _C = GaugeMetricFamily, CounterMetricFamily
# (family, name, help, EngineStats field), in the order /metrics lists them.
_STATS_METRICS = (
    (_G, "vllm:num_requests_running", "Requests in the running batch.", "num_running"),
    (_G, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    (_G, "vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", "kv_cache_usage"),
    (
        _C,
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_queries_tokens",
    ),
    (
        _C,
        "vllm:prefix_cache_hits",
        "Prompt tokens found in the prefix cache (on the GPU; the host tier's: "
        "vllm:external_prefix_cache_hits).",
        "prefix_hits_tokens",
    ),
    (_C, "vllm:prompt_tokens", "Prompt tokens processed.", "prompt_tokens_total"),
    (_C, "vllm:generation_tokens", "Tokens generated.", "generation_tokens_total"),
    (
        _C,
        "kvgate_worker_prefix_hint_blocks",
        "Cached blocks kept from eviction on a request's arrival, named by the gateway's "
        "x-kvgate-prefix header (the hit it predicted).",
        "prefix_hint_blocks",
    ),
    (
        _C,
        "kvgate_worker_encoder_cache_hits",
        "Images whose embeddings came from the encoder cache.",
        "encoder_cache_hits",
    ),
    (
        _C,
        "kvgate_worker_images_processed",
        "Images whose placeholder tokens a step computed to their end (not those in a prefix hit).",
        "images_processed",
    ),
    (_C, "kvgate_worker_vision_tower_runs", "Vision-tower forward passes.", "vision_tower_runs"),
    (
        _G,
        "kvgate_worker_hidden_state_cache_bytes",
        "Memory of the hidden-state cache (0 without --hidden-state-cache).",
        "hidden_cache_bytes",
    ),
    (
        _C,
        "kvgate_worker_hidden_state_queries",
        "Prompt tokens of requests that wanted hidden states (embeddings, return_hidden_states).",
        "hidden_queries_tokens",
    ),
    (
        _C,
        "kvgate_worker_hidden_state_hits",
        "Of those, prompt tokens served from the prefix cache (not recomputed).",
        "hidden_hits_tokens",
    ),
)


def _lora_metrics(loras: list[tuple[list[str], LoRAStats]]) -> Iterator:
    """vLLM's vllm:lora_requests_info: the adapters with running and with waiting requests,
    comma-separated, and max_lora, on a sample whose value is the time it was taken. Several
    engines (each with its own slots) give one sample each, told apart by an `engine` label;
    one engine gives vLLM's label set exactly."""
    labels = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
    many = len(loras) > 1
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=[*labels, "engine"] if many else labels,
    )
    loads = CounterMetricFamily(
        "kvgate_worker_lora_loads",
        "LoRA adapters copied into a device slot.",
        labels=["model_name", "engine"],
    )
    now = time.time()
    for (model, engine), lora in loras:
        running, waiting = ",".join(lora.running), ",".join(lora.waiting)
        values = [str(lora.max_loras), running, waiting]
        info.add_metric([*values, engine] if many else values, now)
        loads.add_metric([model, engine], lora.loads)
    yield info
    yield loads


@dataclass(frozen=True, slots=True)
class EngineLatency:
    """The latency histograms of one engine (its `engine` label)."""

    ttft: Any
    e2e: Any
    queue_time: Any
    prefill_time: Any
    prefill_kv_computed: Any

    def first_token(self, out: RequestOutput) -> None:
        """Record a request's queue and prefill intervals (a no-op after its first token)."""
        if out.prefill_s is None or out.queue_s is None:
            return
        self.queue_time.observe(out.queue_s)
        self.prefill_time.observe(out.prefill_s)
        self.prefill_kv_computed.observe(out.num_prompt_tokens - out.num_cached_tokens)


class WorkerMetrics:
    def __init__(
        self,
        engines: list[tuple[str, Callable[[], EngineStats]]],
        model_name: str,
        *,
        block_size: int,
        num_gpu_blocks: int,
        enable_prefix_caching: bool,
    ) -> None:
        """`engines`: each engine's `engine` label (its data-parallel rank) and stats."""
        self.registry = CollectorRegistry(auto_describe=False)
        info = {
            "block_size": str(block_size),
            "num_gpu_blocks": str(num_gpu_blocks),
            "enable_prefix_caching": str(enable_prefix_caching),
        }
        self.registry.register(_EngineCollector(engines, model_name, info))
        ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        e2e = self._histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS
        )
        # Per request, at its first token (vLLM's intervals): the gateway divides the prefill
        # seconds by the computed tokens for each worker's prefill rate (docs/gateway.md).
        queue = self._histogram(
            "vllm:request_queue_time_seconds",
            "Time from arrival to the latest admission to the running batch.",
            _TTFT_BUCKETS,
        )
        prefill = self._histogram(
            "vllm:request_prefill_time_seconds",
            "Time from the latest admission to the first token.",
            _TTFT_BUCKETS,
        )
        computed = self._histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens computed in prefill (prefix-cache hits excluded).",
            _TOKEN_BUCKETS,
        )
        self.engines = [
            EngineLatency(*(h.labels(model_name, e) for h in (ttft, e2e, queue, prefill, computed)))
            for e, _ in engines
        ]

    def _histogram(self, name: str, doc: str, buckets: tuple) -> Histogram:
        labels = ["model_name", "engine"]
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
