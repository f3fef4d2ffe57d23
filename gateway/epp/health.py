"""gRPC's health service (grpc.health.v1.Health: Check and Watch) on gateway/epp/rpc.py.

The same behaviour as grpcio-health-checking's servicer: a service never set is NOT_FOUND to
Check and SERVICE_UNKNOWN to Watch; `enter_graceful_shutdown()` turns every service
NOT_SERVING for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from .rpc import Call, Method, Status

SERVING = HealthCheckResponse.SERVING
NOT_SERVING = HealthCheckResponse.NOT_SERVING
_UNKNOWN = HealthCheckResponse.SERVICE_UNKNOWN


class Health:
    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._watchers: set[asyncio.Queue[int]] = set()
        self._shut_down = False

    def methods(self) -> dict[str, Method]:
        parse = HealthCheckRequest.FromString
        return {
            "/grpc.health.v1.Health/Check": Method(parse, self._check),
            "/grpc.health.v1.Health/Watch": Method(parse, self._watch),
        }

    def set(self, service: str, status: int) -> None:
        if self._shut_down:
            return
        self._status[service] = status
        for q in self._watchers:
            q.put_nowait(0)

    def enter_graceful_shutdown(self) -> None:
        for service in self._status:
            self.set(service, NOT_SERVING)
        self._shut_down = True

    async def _check(self, requests: AsyncIterator, call: Call) -> AsyncIterator:
        service = await _service(requests, call)
        if service not in self._status:
            await call.abort(Status.NOT_FOUND, f"unknown service {service!r}")
        yield HealthCheckResponse(status=self._status[service])

    async def _watch(self, requests: AsyncIterator, call: Call) -> AsyncIterator:
        service = await _service(requests, call)
        changed: asyncio.Queue[int] = asyncio.Queue()
        self._watchers.add(changed)
        try:
            last = None
            while True:
                status = self._status.get(service, _UNKNOWN)
                if status != last:
                    last = status
                    yield HealthCheckResponse(status=status)
                await changed.get()
        finally:
            self._watchers.discard(changed)


async def _service(requests: AsyncIterator, call: Call) -> str:
    request = await anext(requests, None)
    if request is None:
        await call.abort(Status.INVALID_ARGUMENT, "no HealthCheckRequest")
    return request.service
