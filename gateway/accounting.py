"""Per-request accounting: in-flight load, speculative entries, predicted vs reported cache."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cachekey.keys import clamp_match
from cachekey.types import BlockKey, Prompt
from gateway.index import ReplicaId
from gateway.replicas import Replica
from gateway.state import GatewayState


@dataclass(slots=True)
class RequestLedger:
    """What one request has charged to the replicas it tried, undone as each attempt ends."""

    state: GatewayState
    prompt: Prompt
    keys: list[BlockKey]
    matched: dict[ReplicaId, int]
    block_size: int
    policy: str
    predicted: dict[ReplicaId, int] = field(default_factory=dict)

    def predicted_for(self, rep: Replica) -> int:
        """The worker's cache hit we expect: the match, clamped as the worker clamps it."""
        if not rep.parity_ok:
            return 0
        bs = self.block_size
        n = self.matched.get(rep.id, 0) * bs
        return clamp_match(n, len(self.prompt), bs, self.prompt.mm_items)

    def begin(self, rep: Replica) -> None:
        st = self.state
        cached = self.predicted[rep.id] = self.predicted_for(rep)
        uncached = len(self.prompt) - cached
        rep.in_flight += 1
        rep.in_flight_prefill_tokens += uncached
        rep.add_recent_prefill(uncached, time.monotonic(), st.config.recent_half_life)
        st.metrics.in_flight.labels(rep.id).set(rep.in_flight)
        if rep.parity_ok:
            st.index.add_speculative(rep.id, self.keys)

    def release(self, rep: Replica) -> None:
        rep.in_flight -= 1
        rep.in_flight_prefill_tokens -= len(self.prompt) - self.predicted[rep.id]
        self.state.metrics.in_flight.labels(rep.id).set(rep.in_flight)

    def fail(self, rep: Replica) -> None:
        """An attempt that failed before the first byte: the request moves on."""
        self.release(rep)
        self.state.replicas.record_failure(rep)
        self.state.metrics.requests.labels(rep.id, self.policy, "retried").inc()
        self.state.metrics.retries.inc()

    def finish(self, rep: Replica, status: str, usage: dict | None) -> None:
        self.release(rep)
        m = self.state.metrics
        m.requests.labels(rep.id, self.policy, status).inc()
        predicted = self.predicted[rep.id]
        m.prompt_tokens.labels(rep.id).inc(len(self.prompt))
        m.predicted_cached.labels(rep.id).inc(predicted)
        details = (usage or {}).get("prompt_tokens_details") or {}
        reported = details.get("cached_tokens")
        if reported is not None:
            m.reported_cached.labels(rep.id).inc(reported)
            m.prediction_error.observe(abs(predicted - reported))
