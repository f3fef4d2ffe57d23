"""The EPP's gRPC server: Envoy's ExternalProcessor service and gRPC health, on the gateway's loop.

It runs beside the HTTP app in the same process and event loop, on the same `GatewayState`: one
index, one set of replicas, one admission. Health follows the endpoint picker protocol: the
services `liveness` (the process answers), `readiness` and
`envoy.service.ext_proc.v3.ExternalProcessor` (the worker set has been discovered at least once).
gRPC is served by gateway/epp/rpc.py over gateway/epp/h2.py, on the event loop itself (why:
gateway/epp/h2.py).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from gateway.state import GatewayState

from .health import NOT_SERVING, SERVING, Health
from .rpc import Call, Method, RpcServer
from .stream import ExtProcStream

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_PROCESS = f"/{EXT_PROC_SERVICE}/Process"
# Room around the largest request body for the message that carries it (BUFFERED: one message).
_MESSAGE_SLACK = 1 << 20


class EppServer:
    """`start()` binds and serves; `mark_synced()` turns readiness on; `stop()` drains."""

    def __init__(self, state: GatewayState, host: str, port: int) -> None:
        self.state = state
        c = state.config
        self.tls = (c.epp_tls_cert_file, c.epp_tls_key_file)
        self.health = Health()
        methods = {_PROCESS: Method(ProcessingRequest.FromString, self._process),
                   **self.health.methods()}  # fmt: skip
        self.server = RpcServer(methods, c.limits.max_body_bytes + _MESSAGE_SLACK)
        self.host, self.port = host, port
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.synced = False
        self._stopping: asyncio.Future | None = None

    def _process(self, requests: AsyncIterator, call: Call) -> AsyncIterator:
        return ExtProcStream(self.state, requests, call).run()

    async def start(self) -> None:
        cert, key = self.tls
        tls = None
        if cert and key:  # read at start: a missing file fails the start, not a request
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.load_cert_chain(cert, key)
            tls.set_alpn_protocols(["h2"])  # gRPC clients require HTTP/2 by ALPN
        self.health.set("liveness", SERVING)
        for service in ("readiness", EXT_PROC_SERVICE):
            self.health.set(service, NOT_SERVING)
        await self.server.start(self.host, self.port, tls)  # raises when the port is taken
        log.info("endpoint picker (ext_proc) listening on %s", self.address)

    async def mark_synced(self) -> None:
        if not self.synced:
            self.synced = True
            for service in ("readiness", EXT_PROC_SERVICE):
                self.health.set(service, SERVING)

    def drain(self, grace: float) -> None:
        """Start stopping: readiness NOT_SERVING, new streams refused (the proxies get a GOAWAY
        and open them elsewhere), streams in flight cut after `grace` seconds."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace))

    async def stop(self, grace: float = 5.0) -> None:
        """Drain (with `grace`, unless a drain has begun) and wait until it is done."""
        self.drain(grace)
        assert self._stopping is not None
        await self._stopping

    async def _stop(self, grace: float) -> None:
        self.health.enter_graceful_shutdown()
        try:
            async with asyncio.timeout(grace + 10.0):
                await self.server.stop(grace)
        except TimeoutError:
            log.error("the ext_proc server did not stop within %.0f s; exiting anyway", grace + 10)
