"""Where the proxy sent a request: the EPP counts it where it was served, not where it was picked.

With the response headers the proxy says what became of the pick: the endpoint that served it
(the protocol's `envoy.lb/x-gateway-destination-endpoint-served`, which Envoy's `override_host`
policy writes, or the ext_proc attribute `upstream.address`), and, where Envoy sends the
attribute `response.code_details`, whether the answer came from that upstream at all
(`via_upstream`) or from the proxy itself (no healthy upstream, a refused connection, a
timeout). A proxy that says neither (ORIGINAL_DST without attributes) sent it to the pick.
"""

from __future__ import annotations

import logging

from gateway import accounting
from gateway.fleet.replica import Replica
from gateway.routing.request import ProxyRequest
from gateway.state import GatewayState

from . import wire

log = logging.getLogger(__name__)
_warned: set[str] = set()  # endpoints outside the pool already logged (a misconfigured proxy
# would otherwise log every request)


def settle(state: GatewayState, px: ProxyRequest, msg, rank: int | None) -> None:
    """Move `px`'s lease to the replica that served it, or drop it when nothing was delivered.

    Either way the pick's failure counts for the circuit breaker, as a retry's does. A request
    the proxy answered itself reached no worker, so nothing stays charged, predicted or counted
    there (it ends as answered here); one sent elsewhere is counted where it went: the slot, the
    prefill charge, the speculative entry and the prediction move there, even over its cap."""
    lease = px.lease
    rep = lease.replica
    if rep is None:
        return
    details = wire.attribute(msg, "response.code_details")
    if details is not None and details != wire.VIA_UPSTREAM:
        status = wire.header_dict(msg.response_headers.headers).get(":status", "?")
        reason = f"the proxy answered {status} itself ({details})"
        accounting.attempt_failed(state, rep, px.policy_name, reason)
        lease.drop()
        return
    served = wire.served_endpoint(msg.metadata_context) or wire.attribute(msg, "upstream.address")
    if served is None or wire.endpoint_of(rep.url) == served:
        return
    target = replica_at(state, served, rank)
    if target is None:
        _warn_once(served)
        return
    if target is not rep:
        reason = f"the proxy sent it to {target.name}"
        accounting.attempt_failed(state, rep, px.policy_name, reason)
        lease.transfer(target, px.prediction(target))


def replica_at(state: GatewayState, endpoint: str, rank: int | None) -> Replica | None:
    """The replica behind `endpoint` that takes the X-data-parallel-rank `rank` (None: none)."""
    for r in state.replicas:
        if wire.endpoint_of(r.url) == endpoint and r.rank_header == rank:
            return r
    return None


def _warn_once(endpoint: str) -> None:
    if endpoint in _warned or len(_warned) >= 1024:
        log.debug("the proxy served a request on %s, not a worker of the pool", endpoint)
        return
    _warned.add(endpoint)
    log.warning(
        "the proxy served a request on %s, which is not a worker of the pool (logged once per "
        "endpoint; the rest at debug level)",
        endpoint,
    )
