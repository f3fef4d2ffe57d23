"""Outcomes, recorded in one place: the circuit breaker and the per-request metrics.

An attempt either fails before the first byte (the breaker counts it, the request moves on) or
is answered (the breaker's streak resets). A request ends once, with the HTTP status its client
got, or `client_gone` when the client left first: answered by a replica, or by the gateway
itself (refused, overloaded, or every replica failed). Predicted vs reported cached tokens are
recorded only for answers a replica served (2xx): a worker's refusal cached nothing.
"""

from __future__ import annotations

from typing import Protocol

from gateway.fleet.breaker import CircuitBreaker
from gateway.fleet.replica import Replica
from gateway.metrics import GatewayMetrics

CLIENT_GONE = "client_gone"  # the client left before the end of its answer


class Recorder(Protocol):
    """Where outcomes go (the app's GatewayState is one): the breaker and the metrics."""

    breaker: CircuitBreaker
    metrics: GatewayMetrics


def served(status: str) -> bool:
    """The replica served the request (not a refusal, a failure, or a client gone)."""
    return status.startswith("2")


def attempt_failed(state: Recorder, rep: Replica, policy: str, reason: str) -> None:
    state.breaker.failure(rep, reason)
    m = state.metrics
    m.child(m.requests, rep.name, policy, "retried").inc()
    m.retries.inc()


def attempt_answered(state: Recorder, rep: Replica) -> None:
    state.breaker.success(rep)


def answered_here(state: Recorder, policy: str, status: str) -> None:
    """A request no replica answered: refused at any stage, overloaded, every replica failed,
    or its client gone before it reached one."""
    m = state.metrics
    m.child(m.requests, "none", policy, status).inc()


def finished(
    state: Recorder,
    rep: Replica,
    policy: str,
    status: str,
    prompt_tokens: int,
    predicted: tuple[int, int],
    usage: dict | None,
) -> None:
    """A request a replica answered: its status and, if served, predicted (in all, and of
    those its host tier's) vs reported cached tokens (the worker reports both tiers as one,
    as vLLM does)."""
    m = state.metrics
    m.child(m.requests, rep.name, policy, status).inc()
    if not served(status):
        return
    m.child(m.prompt_tokens, rep.name).inc(prompt_tokens)
    predicted, host = predicted
    m.child(m.predicted_cached, rep.name).inc(predicted)
    if host:
        m.child(m.predicted_host_cached, rep.name).inc(host)
    details = (usage or {}).get("prompt_tokens_details") or {}
    reported = details.get("cached_tokens")
    if reported is not None:
        m.child(m.reported_cached, rep.name).inc(reported)
        m.prediction_error.observe(abs(predicted - reported))
