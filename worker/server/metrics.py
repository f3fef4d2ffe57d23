"""Prometheus metrics with vLLM's names, on a registry owned by one app (never the global one).

Engine-side numbers (queues, KV usage, cumulative token counters) are read from the stats the
engine thread last recorded, at scrape time; request latencies are observed by the handlers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from worker.engine.llm_engine import EngineStats, RequestOutput
from worker.engine.outputs import LoRAStats

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
    def __init__(self, stats: Callable[[], EngineStats], model_name: str, info: dict[str, str]):
        self._stats = stats
        self._model = model_name
        self._info = info

    def collect(self) -> Iterator:
        s = self._stats()
        labels = ["model_name"]
        values = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", s.kv_cache_usage)
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_queries_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            s.prefix_hits_tokens,
        )
        yield counter("vllm:prompt_tokens", "Prompt tokens processed.", s.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield counter(
            "kvgate_worker_encoder_cache_hits",
            "Images whose embeddings came from the encoder cache.",
            s.encoder_cache_hits,
        )
        yield counter(
            "kvgate_worker_images_processed", "Images in admitted requests.", s.images_processed
        )
        yield counter(
            "kvgate_worker_vision_tower_runs", "Vision-tower forward passes.", s.vision_tower_runs
        )
        yield gauge(
            "kvgate_worker_hidden_state_cache_bytes",
            "Memory of the hidden-state cache (0 without --hidden-state-cache).",
            s.hidden_cache_bytes,
        )
        yield counter(
            "kvgate_worker_hidden_state_queries",
            "Prompt tokens of requests that wanted hidden states (embeddings, "
            "return_hidden_states).",
            s.hidden_queries_tokens,
        )
        yield counter(
            "kvgate_worker_hidden_state_hits",
            "Of those, prompt tokens served from the prefix cache (not recomputed).",
            s.hidden_hits_tokens,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "KV-cache configuration.", labels=list(self._info)
        )
        info.add_metric(list(self._info.values()), 1.0)
        yield info
        if s.lora is not None:
            yield from _lora_metrics(s.lora, counter)


def _lora_metrics(lora: LoRAStats, counter) -> Iterator:
    """vLLM's vllm:lora_requests_info: the adapters with running and with waiting requests,
    comma-separated, and max_lora, on a sample whose value is the time it was taken."""
    labels = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
    info = GaugeMetricFamily(
        "vllm:lora_requests_info", "Running stats on lora requests.", labels=labels
    )
    info.add_metric(
        [str(lora.max_loras), ",".join(lora.running), ",".join(lora.waiting)], time.time()
    )
    yield info
    yield counter(
        "kvgate_worker_lora_loads", "LoRA adapters copied into a device slot.", lora.loads
    )


class WorkerMetrics:
    def __init__(
        self,
        stats: Callable[[], EngineStats],
        model_name: str,
        *,
        block_size: int,
        num_gpu_blocks: int,
        enable_prefix_caching: bool,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        info = {
            "block_size": str(block_size),
            "num_gpu_blocks": str(num_gpu_blocks),
            "enable_prefix_caching": str(enable_prefix_caching),
        }
        self.registry.register(_EngineCollector(stats, model_name, info))
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS, model_name
        )
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            _E2E_BUCKETS,
            model_name,
        )
        # Per request, at its first token (vLLM's intervals): the gateway divides the prefill
        # seconds by the computed tokens for each worker's prefill rate (docs/gateway.md).
        self.queue_time = self._histogram(
            "vllm:request_queue_time_seconds",
            "Time from arrival to the latest admission to the running batch.",
            _TTFT_BUCKETS,
            model_name,
        )
        self.prefill_time = self._histogram(
            "vllm:request_prefill_time_seconds",
            "Time from the latest admission to the first token.",
            _TTFT_BUCKETS,
            model_name,
        )
        self.prefill_kv_computed = self._histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens computed in prefill (prefix-cache hits excluded).",
            _TOKEN_BUCKETS,
            model_name,
        )

    def _histogram(self, name: str, doc: str, buckets: tuple, model_name: str):
        h = Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)
        return h.labels(model_name)

    def first_token(self, out: RequestOutput) -> None:
        """Record a request's queue and prefill intervals (a no-op after its first token)."""
        if out.prefill_s is None or out.queue_s is None:
            return
        self.queue_time.observe(out.queue_s)
        self.prefill_time.observe(out.prefill_s)
        self.prefill_kv_computed.observe(out.num_prompt_tokens - out.num_cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
