"""Retries: an attempt that fails before the first byte (unreachable, or a 5xx) moves on.

At most `--retries` more replicas are tried, in ranked order, each only if it has a free slot;
the request's lease (its slot and load, gateway/routing/lease.py) moves with the attempt. A
worker's answer below 500 is the request's answer. The 502 names the last replica tried by its name,
never its URL (docs/security.md, *Admin endpoints and replica names*).
"""

from __future__ import annotations

from cachekey.headers import PREFIX_HEADER, RANK_HEADER
from gateway import accounting
from gateway.errors import UpstreamFailed
from gateway.fleet.replica import Replica
from gateway.names import ReplicaId
from gateway.routing.request import ProxyRequest
from gateway.upstream.pool import UpstreamError, UpstreamResponse


async def send_with_retries(px: ProxyRequest, payload: bytes) -> UpstreamResponse:
    """POST `payload` to the request's replica, then to the next ones, until one answers."""
    st, lease = px.state, px.lease
    attempts = st.config.retries + 1
    tried: set[ReplicaId] = set()
    failed = UpstreamFailed("no replica available")
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
            failed = UpstreamFailed(f"{rep.name}: {reason}", resp.status, await resp.read())
        accounting.attempt_failed(st, rep, px.policy_name, reason)
        rest = [] if len(tried) >= attempts else [r for r in px.ranked if r.id not in tried]
        lease.move(rest, px.prediction)
    raise failed


_RANK = RANK_HEADER.encode()
_PREFIX = PREFIX_HEADER.encode()


def _header_lines(px: ProxyRequest, rep: Replica) -> bytes:
    """The raw header lines the attempt on `rep` adds: its X-data-parallel-rank, and the
    `x-kvgate-prefix` hint of the hit predicted there (ProxyRequest.prefix_hint)."""
    n = rep.rank_header
    rank = b"" if n is None else b"%b: %d\r\n" % (_RANK, n)
    hint = px.prefix_hint()
    return rank if hint is None else rank + b"%b: %b\r\n" % (_PREFIX, hint.encode())
