"""Retries: an attempt that fails before the first byte (unreachable, or a 5xx) moves on.

At most `--retries` more replicas are tried, in ranked order, each only if it has a free slot;
the request's lease (its slot and load, gateway/routing/lease.py) moves with the attempt. A
worker's answer below 500 is the request's answer. The 502 names the last replica tried by its name,
never its URL (docs/security.md, *Admin endpoints and replica names*). A request whose attempt
killed a second engine (`engine_died` twice) is tried on no third, and is held in quarantine
(gateway/quarantine.py).
"""

from __future__ import annotations

import json
import logging

from cachekey.headers import PREFIX_HEADER, RANK_HEADER
from cachekey.openai.errors import ENGINE_DIED
from gateway import accounting
from gateway.errors import EngineKiller, UpstreamFailed
from gateway.fleet.replica import Replica
from gateway.names import ReplicaId
from gateway.routing.request import ProxyRequest
from gateway.upstream.pool import UpstreamError, UpstreamResponse

log = logging.getLogger(__name__)


async def send_with_retries(px: ProxyRequest, payload: bytes) -> UpstreamResponse:
    """POST `payload` to the request's replica, then to the next ones, until one answers."""
    st, lease = px.state, px.lease
    if st.quarantine.holds(payload):
        raise EngineKiller(st.quarantine.ttl)
    attempts = st.config.retries + 1
    tried: set[ReplicaId] = set()
    failed = UpstreamFailed("no replica available")
    killed: list[str] = []  # the replicas whose engines died with it
    while (rep := lease.replica) is not None:
        tried.add(rep.id)
        assert rep.link.pool is not None
        try:
            resp = await rep.link.pool.post(px.endpoint, payload, _header_lines(px, rep))
        except UpstreamError as e:
            reason = str(e)
            failed = UpstreamFailed(f"{rep.name}: {reason}")
        else:
            if resp.status < 500:
                accounting.attempt_answered(st, rep)
                return resp
            reason = f"HTTP {resp.status}"
            answer = await resp.read()
            failed = UpstreamFailed(f"{rep.name}: {reason}", resp.status, answer)
            if _engine_died(answer):
                killed.append(rep.name)
        accounting.attempt_failed(st, rep, px.policy_name, reason)
        if len(killed) == 2:
            st.quarantine.hold(payload)
            log.warning("a request was in %s's engines when they died: not tried again", killed)
            raise EngineKiller(st.quarantine.ttl)
        rest = [] if len(tried) >= attempts else [r for r in px.ranked if r.id not in tried]
        lease.move(rest, px.prediction)
    raise failed


def _engine_died(answer: bytes) -> bool:
    """A kvgate worker's 503 for a request that was in its engine when it died."""
    if ENGINE_DIED.encode() not in answer:
        return False
    try:
        return json.loads(answer)["error"]["code"] == ENGINE_DIED
    except (ValueError, KeyError, TypeError):
        return False


_RANK = RANK_HEADER.encode()
_PREFIX = PREFIX_HEADER.encode()


def _header_lines(px: ProxyRequest, rep: Replica) -> bytes:
    """The raw header lines the attempt on `rep` adds: its X-data-parallel-rank, and the
    `x-kvgate-prefix` hint of the hit predicted there (ProxyRequest.prefix_hint)."""
    n = rep.rank_header
    rank = b"" if n is None else b"%b: %d\r\n" % (_RANK, n)
    hint = px.prefix_hint()
    return rank if hint is None else rank + b"%b: %b\r\n" % (_PREFIX, hint.encode())
