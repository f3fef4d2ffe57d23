"""The gateway's Prometheus metrics (`kvgate_*`), one registry per app so tests can run several."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
_TOKEN_BUCKETS = (0, 1, 16, 64, 256, 1024, 4096, 16384)
_RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 2, 5)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._children: dict[tuple[str, tuple[str, ...]], Counter] = {}
        self._add_request_metrics(r)
        self._add_routing_metrics(r)
        self._add_event_metrics(r)
        self._add_peer_metrics(r)
        self._add_replica_metrics(r)

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """What the request path records: outcomes, predicted and reported cached tokens."""
        self.requests = Counter(
            "kvgate_requests",
            "Requests, each counted once with its outcome (replica none: answered by the gateway)",
            ["replica", "policy", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvgate_prompt_tokens", "Prompt tokens of the requests served", ["replica"], registry=r
        )
        self.predicted_cached = Counter(
            "kvgate_predicted_cached_tokens",
            "Cached prompt tokens the gateway predicted, for the requests served",
            ["replica"],
            registry=r,
        )
        self.predicted_host_cached = Counter(
            "kvgate_predicted_cpu_cached_tokens",
            "Of the predicted cached prompt tokens, those the replica's host-memory tier serves "
            "(copied back to the GPU, not recomputed)",
            ["replica"],
            registry=r,
        )
        self.reported_cached = Counter(
            "kvgate_reported_cached_tokens",
            "Cached prompt tokens the workers reported (usage.prompt_tokens_details)",
            ["replica"],
            registry=r,
        )
        self.prediction_error = Histogram(
            "kvgate_prediction_error_tokens",
            "|predicted - reported| cached tokens per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.retries = Counter("kvgate_retries", "Attempts retried on another replica", registry=r)

    def _add_routing_metrics(self, r: CollectorRegistry) -> None:
        """What the routing decision records: its time, its render's, its spills, and how far
        the latency model it priced replicas by was off."""
        self.ttft_prediction_error = Histogram(
            "kvgate_route_ttft_prediction_error_ratio",
            "|observed - predicted| / observed time to first token per request, as the gateway "
            "timed it, against what the replica's fitted latency model predicted when routing "
            "(cache_aware; gateway/fleet/latency.py)",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.spills = Counter(
            "kvgate_route_spills",
            "Requests placed on a replica holding a shorter prefix than another candidate: the "
            "queue there was estimated to cost more than recomputing (cache_aware)",
            ["policy"],
            registry=r,
        )
        self.spill_tokens = Counter(
            "kvgate_route_spill_tokens",
            "Prompt tokens recomputed because of spills (longest prefix - prefix used)",
            ["policy"],
            registry=r,
        )
        self.routing_seconds = Histogram(
            "kvgate_routing_decision_seconds",
            "Match + policy time per request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.render_seconds = Histogram(
            "kvgate_render_seconds",
            "Render + block-key time per request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _add_event_metrics(self, r: CollectorRegistry) -> None:
        """The index and the KV events that feed it."""
        self.index_blocks = Gauge("kvgate_index_blocks", "Gateway keys in the index", registry=r)
        self.index_bytes = Gauge("kvgate_index_bytes", "Estimated index memory", registry=r)
        self.events_applied = Counter(
            "kvgate_events_applied", "KV events applied", ["replica"], registry=r
        )
        self.event_gaps = Counter(
            "kvgate_event_gaps", "Sequence gaps found (live stream or tail check)", registry=r
        )
        self.event_lag = Histogram(
            "kvgate_event_lag_seconds",
            "From a KV-event batch's timestamp (the worker publishing it) to its being applied "
            "to the index; needs the workers' and gateway's clocks in step (NTP)",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.ingest_seconds = Counter(
            "kvgate_event_ingest_cpu_seconds",
            "CPU time of the ingestion thread decoding, hashing and applying KV-event batches: "
            "near 1 per second, the gateway cannot keep up with the workers' events",
            registry=r,
        )
        self.event_replays = Counter("kvgate_event_replays", "Gaps closed by replay", registry=r)
        self.event_resyncs = Counter("kvgate_event_resyncs", "Snapshot reloads", registry=r)
        self.event_tail_gaps = Counter(
            "kvgate_event_tail_gaps",
            "Gaps no later batch revealed, found by the replay check after an idle interval",
            registry=r,
        )
        self.skipped_unknown_parent = Counter(
            "kvgate_events_skipped_unknown_parent",
            "BlockStored events skipped: parent not in the index",
            registry=r,
        )
        self.event_errors = Counter(
            "kvgate_event_errors",
            "Malformed KV-event batches, events or fields skipped, by reason",
            ["reason"],
            registry=r,
        )

    def _add_peer_metrics(self, r: CollectorRegistry) -> None:
        """The other gateway replicas (gateway/peers/)."""
        self.peers_up = Gauge("kvgate_peers_up", "Peer gateways heard from lately", registry=r)
        self.peer_lag = Histogram(
            "kvgate_peer_lag_seconds",
            "From a peer's batch being sent to its being applied here (clocks in step)",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.peer_placements_received = Counter(
            "kvgate_peer_placements_received", "Placement changes received from peers", registry=r
        )
        self.peer_placements_applied = Counter(
            "kvgate_peer_placements_applied",
            "Placement changes applied to the index (not: a replica not routed to here)",
            registry=r,
        )
        self.peer_placements_sent = Counter(
            "kvgate_peer_placements_sent", "Placement changes sent to the peers", registry=r
        )
        self.peer_placements_dropped = Counter(
            "kvgate_peer_placements_dropped",
            "Placement changes dropped: the queue to the peers was full",
            registry=r,
        )

    def _add_replica_metrics(self, r: CollectorRegistry) -> None:
        """The replicas: health, parity, in-flight requests and prefill rate."""
        self.replica_healthy = Gauge(
            "kvgate_replica_healthy", "1 when the replica takes traffic", ["replica"], registry=r
        )
        self.parity_mismatch = Gauge(
            "kvgate_parity_mismatch",
            "1 when the replica's key fingerprint differs from its model's majority",
            ["replica"],
            registry=r,
        )
        self.in_flight = _InFlight()
        r.register(self.in_flight)

    def child(self, metric: Counter, *labels: str) -> Counter:
        """`metric.labels(*labels)`, looked up once per label set (it takes a lock and a
        tuple build on every call; the request path records a few per request)."""
        key = (metric._name, labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def render(self) -> bytes:
        return generate_latest(self.registry)


class FittedModel(Protocol):
    """What the scrape reads of a replica's latency model (gateway/fleet/latency.py
    `LatencyModel`, on a floor above: the metrics sit at the bottom)."""

    mean_error: float

    @property
    def fitted(self) -> bool: ...

    def coefficients(self) -> Any: ...  # its terms as attributes: base, per_token, ...


class _InFlight(Collector):
    """Per-replica gauges read from the replicas when scraped: kvgate_in_flight_requests,
    kvgate_in_flight_tokens (their prompts: the context they hold),
    kvgate_replica_prefill_seconds_per_token (the rate cache_aware measured; absent until then),
    kvgate_replica_copy_seconds_per_token (its host-tier copy rate, likewise),
    kvgate_replica_ttft_model_seconds (its fitted latency model's coefficients, once fitted) and
    kvgate_replica_info (name and URL, the join between them)."""

    def __init__(self) -> None:
        # (name, replica id, in-flight requests, their prompt tokens, measured seconds per
        # prefill token and per host-tier token copied back, or None, its latency model)
        self.source: Callable[
            [], Iterable[tuple[str, str, int, int, tuple[float | None, float | None], FittedModel]]
        ] = tuple

    def collect(self) -> Iterable[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "kvgate_in_flight_requests",
            "Requests in flight: this gateway's and, with peers, theirs",
            labels=["replica"],
        )
        held = GaugeMetricFamily(
            "kvgate_in_flight_tokens",
            "Prompt tokens (cached or not) of the requests in flight: the context they hold",
            labels=["replica"],
        )
        rate = GaugeMetricFamily(
            "kvgate_replica_prefill_seconds_per_token",
            "Seconds per uncached prompt token, from the worker's vllm:request_prefill_* sums",
            labels=["replica"],
        )
        copy = GaugeMetricFamily(
            "kvgate_replica_copy_seconds_per_token",
            "Seconds per prompt token copied back from the host KV tier, from the worker's "
            "vllm:kv_offload_load_time over its vllm:external_prefix_cache_hits",
            labels=["replica"],
        )
        model = GaugeMetricFamily(
            "kvgate_replica_ttft_model_seconds",
            "The replica's fitted TTFT model (gateway/fleet/latency.py), by term: base, "
            "per_token (uncached prompt token), per_queued (prefill token queued there), "
            "per_waiting (request queued there), per_request (request there); mean_error is the "
            "smoothed relative error of the predictions its requests were routed by",
            labels=["replica", "term"],
        )
        info = GaugeMetricFamily(
            "kvgate_replica_info",
            "1 per replica: its name (the replica label everywhere) and its worker URL, to join",
            labels=["replica", "url"],
        )
        for name, url, n, tokens, (seconds, copying), latency in self.source():
            g.add_metric([name], n)
            held.add_metric([name], tokens)
            info.add_metric([name, url], 1)
            if seconds is not None:
                rate.add_metric([name], seconds)
            if copying is not None:
                copy.add_metric([name], copying)
            if latency.fitted:
                c = latency.coefficients()
                for term in ("base", "per_token", "per_queued", "per_waiting", "per_request"):
                    model.add_metric([name, term], getattr(c, term))
                model.add_metric([name, "mean_error"], latency.mean_error)
        yield g
        yield held
        yield rate
        yield copy
        yield model
        yield info
