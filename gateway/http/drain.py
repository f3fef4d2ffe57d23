"""Graceful shutdown: what a rollout's SIGTERM does to a gateway (HTTP and EPP mode alike).

At once the listening sockets close (so readiness fails: the chart's probe of `/health` is
refused) and idle keep-alive connections close; the EPP's gRPC health says NOT_SERVING and it
sends its proxies a GOAWAY (streams open on them go on, new ones go to another EPP). Requests
and streams in flight then have `--drain-timeout` seconds to finish (uvicorn's
`timeout_graceful_shutdown`, and the gRPC server's grace); what is left after that is cut, and
the process exits. The pollers and event subscribers keep running meanwhile, so the answers
still in flight are routed and accounted as usual.
"""

from __future__ import annotations

import logging
import socket

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown (on SIGTERM or SIGINT) starts the app's drain first."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.gateway_app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        begin_drain(self.gateway_app)
        await super().shutdown(sockets)


def begin_drain(app: FastAPI) -> None:
    """Stop the EPP taking new streams (the HTTP side is uvicorn's)."""
    state = getattr(app.state, "gateway", None)
    if state is None:  # stopped before it started
        return
    timeout = state.config.drain_timeout
    log.info("draining: no new connections; requests in flight get %gs (--drain-timeout)", timeout)
    epp = getattr(app.state, "epp", None)
    if epp is not None:
        epp.drain(timeout)
