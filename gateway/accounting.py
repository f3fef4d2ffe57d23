"""Outcomes, recorded in one place: the circuit breaker and the per-request metrics.

An attempt either fails before the first byte (the breaker counts it, the request moves on) or
is answered (the breaker's streak resets). A request ends once: served by a replica (its
predicted vs reported cached tokens are recorded) or answered by the gateway itself.
"""

from __future__ import annotations

from gateway.replica import Replica
from gateway.state import GatewayState


def attempt_failed(state: GatewayState, rep: Replica, policy: str, reason: str) -> None:
    state.breaker.failure(rep, reason)
    m = state.metrics
    m.child(m.requests, rep.id, policy, "retried").inc()
    m.retries.inc()


def attempt_answered(state: GatewayState, rep: Replica) -> None:
    state.breaker.success(rep)


def answered_here(state: GatewayState, policy: str, status: str) -> None:
    """A request the gateway answered itself (refused, overloaded, or every replica failed)."""
    m = state.metrics
    m.child(m.requests, "none", policy, status).inc()


def finished(
    state: GatewayState,
    rep: Replica,
    policy: str,
    status: str,
    prompt_tokens: int,
    predicted: int,
    usage: dict | None,
) -> None:
    """A request a replica served: its status and predicted vs reported cached tokens."""
    m = state.metrics
    m.child(m.requests, rep.id, policy, status).inc()
    m.child(m.prompt_tokens, rep.id).inc(prompt_tokens)
    m.child(m.predicted_cached, rep.id).inc(predicted)
    details = (usage or {}).get("prompt_tokens_details") or {}
    reported = details.get("cached_tokens")
    if reported is not None:
        m.child(m.reported_cached, rep.id).inc(reported)
        m.prediction_error.observe(abs(predicted - reported))
