"""Counting the refusals of every route the proxied path does not serve itself.

The proxied POST routes count each request once where it ends (`Exchange.end`). Every other
answer of 400 or more (an unknown URL's 404, a wrong method's 405, `/v1/models`' 401 or 503, the
admin port's 404) is counted here, at the one place every such response passes: the ASGI `send`
of `GatewayApp`. The probes' own answers (`GET /health`, `GET /ready`) are states, not
refusals, and are left out: a probe polling a gateway with no worker must not look like traffic.
"""

from __future__ import annotations

from starlette.datastructures import Headers, State
from starlette.types import Message, Scope, Send

from gateway import accounting
from gateway.routing.policy_choice import policy_label

PROBES = frozenset({"/health", "/ready"})


def counting(app_state: State, scope: Scope, send: Send) -> Send:
    """`send`, counting the response in `kvgate_requests_total{replica="none"}` if refused."""
    if scope["method"] in ("GET", "HEAD") and scope["path"] in PROBES:
        return send

    async def send_counted(message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 400:
            st = getattr(app_state, "gateway", None)
            if st is not None:  # None: before the app started, nothing to count on
                label = policy_label(st, Headers(scope=scope))
                accounting.answered_here(st, label, str(message["status"]))
        await send(message)

    return send_counted
