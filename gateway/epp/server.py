"""The EPP's gRPC server: Envoy's ExternalProcessor service and gRPC health, on the gateway's loop.

It runs beside the HTTP app in the same process and event loop, on the same `GatewayState`: one
index, one set of replicas, one admission. Health follows the endpoint picker protocol: the
services `liveness` (the process answers), `readiness` and
`envoy.service.ext_proc.v3.ExternalProcessor` (the worker set has been discovered at least once).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.state import GatewayState

from .stream import ExtProcStream

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ExternalProcessor(external_processor_pb2_grpc.ExternalProcessorServicer):
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def Process(self, request_iterator, context):  # the gRPC method name
        async for out in ExtProcStream(self.state, aiter(request_iterator), context).run():
            yield out


class EppServer:
    """`start()` binds and serves; `mark_synced()` turns readiness on; `stop()` drains."""

    def __init__(self, state: GatewayState, host: str, port: int) -> None:
        c = state.config
        self.tls = (c.epp_tls_cert_file, c.epp_tls_key_file)
        self.server = grpc.aio.server()
        self.health = health.aio.HealthServicer()
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(state), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.synced = False
        self._stopping: asyncio.Future | None = None

    async def start(self) -> None:
        cert, key = self.tls
        if cert and key:  # read at start: a missing file fails the start, not a request
            chain = [(Path(key).read_bytes(), Path(cert).read_bytes())]
            self.server.add_secure_port(self.address, grpc.ssl_server_credentials(chain))
        else:
            self.server.add_insecure_port(self.address)  # raises when the port is taken
        await self.health.set("liveness", _SERVING)
        for service in ("readiness", EXT_PROC_SERVICE):
            await self.health.set(service, _NOT_SERVING)
        await self.server.start()
        log.info("endpoint picker (ext_proc) listening on %s", self.address)

    async def mark_synced(self) -> None:
        if not self.synced:
            self.synced = True
            for service in ("readiness", EXT_PROC_SERVICE):
                await self.health.set(service, _SERVING)

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
        await self.health.enter_graceful_shutdown()
        try:
            async with asyncio.timeout(grace + 5.0):
                await self.server.stop(grace)
        except TimeoutError:
            log.error("the ext_proc server did not stop within %.0f s; exiting anyway", grace + 5)
