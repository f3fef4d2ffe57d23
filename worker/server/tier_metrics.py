"""The KV tiers' metrics: vLLM's names for its offloading connector, plus hits per tier.

vLLM names a KV connector's prefix hits `vllm:external_prefix_cache_{queries,hits}` (tokens) and
the offloading connector's copies `vllm:kv_offload_total_bytes{transfer_type}` (GPU_to_CPU,
CPU_to_GPU), the seconds its loads took `vllm:kv_offload_load_time` (vLLM 0.32's flat name; a
gateway measures each replica's copy rate from it) and its host cache's fill
`vllm:kv_offload_cpu_cache_usage_perc`; these appear only
with the host tier on, as vLLM's appear only with a connector. vLLM has no single family of hits
by tier: `kvgate_worker_prefix_cache_tier_hits{medium}` gives prompt tokens found on the GPU and
in the host tier side by side (vllm:prefix_cache_hits counts the GPU's alone).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from worker.engine.outputs import EngineStats

Labelled = list[tuple[list[str], EngineStats]]


def tier_metrics(stats: Labelled) -> Iterator:
    """`stats`: each engine's (model_name, engine) label values and stats."""
    labels = ["model_name", "engine"]
    tiers = CounterMetricFamily(
        "kvgate_worker_prefix_cache_tier_hits",
        "Prompt tokens found in each KV tier (GPU: the device cache; CPU: the host tier).",
        labels=[*labels, "medium"],
    )
    for values, s in stats:
        tiers.add_metric([*values, "GPU"], s.prefix_hits_tokens)
        tiers.add_metric([*values, "CPU"], s.host_hits_tokens)
    yield tiers
    offloading = [(values, s) for values, s in stats if s.host_num_blocks]
    if offloading:
        yield from _offload_metrics(offloading, labels)


def _offload_metrics(stats: Labelled, labels: list[str]) -> Iterator:
    queries = CounterMetricFamily(
        "vllm:external_prefix_cache_queries",
        "Prompt tokens looked up past the GPU cache, in the host KV tier.",
        labels=labels,
    )
    hits = CounterMetricFamily(
        "vllm:external_prefix_cache_hits",
        "Prompt tokens found in the host KV tier (copied back, not computed).",
        labels=labels,
    )
    moved = CounterMetricFamily(
        "vllm:kv_offload_total_bytes",
        "KV bytes copied between the GPU cache and the host tier.",
        labels=[*labels, "transfer_type"],
    )
    load_time = CounterMetricFamily(
        "vllm:kv_offload_load_time",
        "Seconds the host tier's copies back to the GPU took (the sim engine's: charged).",
        labels=labels,
    )
    usage = GaugeMetricFamily(
        "vllm:kv_offload_cpu_cache_usage_perc", "Host KV tier usage (1 = full).", labels=labels
    )
    for values, s in stats:
        queries.add_metric(values, s.host_queries_tokens)
        hits.add_metric(values, s.host_hits_tokens)
        moved.add_metric([*values, "GPU_to_CPU"], s.host_saved_bytes)
        moved.add_metric([*values, "CPU_to_GPU"], s.host_loaded_bytes)
        if s.host_load_seconds is not None:  # timed: not the sim engine without a preset
            load_time.add_metric(values, s.host_load_seconds)
        usage.add_metric(values, s.host_cache_usage)
    yield from (queries, hits, moved, usage)
    if load_time.samples:
        yield load_time
