"""Graceful shutdown of a gateway (HTTP and EPP mode alike): kvgate_cli/drain.py's, plus the EPP.

On SIGTERM the listening sockets close and idle keep-alive connections close (kvgate_cli/drain.py);
the EPP's gRPC health says NOT_SERVING and it sends its proxies a GOAWAY (streams open on them go
on, new ones go to another EPP). Requests and streams in flight then have `--drain-timeout`
seconds to finish; a relayed stream still open then is cut with an SSE error event and counted
(`kvgate_requests_total{status="stream_cut"}`). The pollers and event subscribers keep running
meanwhile, so the answers still in flight are routed and accounted as usual.
"""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI

from kvgate_cli.drain import DrainingServer


def draining_server(config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> DrainingServer:
    """uvicorn's server for the gateway app, which drains on SIGTERM."""
    return DrainingServer(
        config,
        streams=app.state.streams,
        drain_timeout=drain_timeout,
        on_drain=lambda: _drain_epp(app),
    )


def _drain_epp(app: FastAPI) -> None:
    """Stop the EPP taking new streams (the HTTP side is uvicorn's)."""
    epp = getattr(app.state, "epp", None)
    if epp is not None:
        epp.drain(app.state.gateway.config.drain_timeout)
