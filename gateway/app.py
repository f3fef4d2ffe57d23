"""create_app(config): the FastAPI app with its state; the lifespan runs discovery and pollers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from gateway.config import GatewayConfig
from gateway.discovery import Discovery
from gateway.discovery.endpoints import WorkerEndpoint
from gateway.discovery.static import StaticDiscovery
from gateway.http.admin import misrouted, not_found
from gateway.http.refusals import counting
from gateway.http.routes import PROXIED, attach_routes, serve_proxied
from gateway.state import GatewayState
from gateway.tasks import cancel_and_wait
from kvgate_cli.drain import OpenStreams

log = logging.getLogger(__name__)


class GatewayApp(FastAPI):
    """FastAPI, with the proxied POST routes served before its middleware and routing.

    They are the hot path: `ProxyServing` answers every failure itself, so the exception
    middleware, dependency solving and routing would only add per-request time (profiled in
    docs/benchmarks.md). The same routes stay registered for the OpenAPI schema, and both
    ways reach `serve_proxied` (gateway/http/routes.py).
    """

    admin_port: int | None = (
        None  # set: /metrics and /kvgate/index only there (gateway/http/admin.py)
    )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        if scope["method"] == "POST" and scope["path"] in PROXIED and not self._misrouted(scope):
            response = await serve_proxied(self.state.gateway, Request(scope, receive))
            await response(scope, receive, send)
            return
        send = counting(self.state, scope, send)  # every other refusal counts once, here
        if self._misrouted(scope):
            await not_found(scope)(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def _misrouted(self, scope: Scope) -> bool:
        return bool(self.admin_port) and misrouted(scope, self.admin_port)  # type: ignore[arg-type]


def build_discovery(config: GatewayConfig) -> Discovery:
    if config.discovery == "inferencepool":
        from gateway.discovery.inferencepool import InferencePoolDiscovery

        assert config.k8s_namespace and config.inference_pool  # GatewayConfig checks
        return InferencePoolDiscovery(config.k8s_namespace, config.inference_pool)
    if config.discovery == "k8s":
        from gateway.discovery.k8s import KubernetesDiscovery  # kubernetes is a heavy import

        return KubernetesDiscovery(
            config.k8s_namespace or "",
            config.k8s_selector,
            config.k8s_port_name,
            service=config.k8s_service,
            events_port_name=config.k8s_kv_events_port_name,
            replay_port_name=config.k8s_kv_replay_port_name,
        )
    return StaticDiscovery(config.workers)


def _find_peers(config: GatewayConfig, state: GatewayState) -> asyncio.Task | None:
    """With --peers-from-kubernetes: a task that keeps the peer link subscribed to every
    gateway pod the selector matches."""
    link = state.peer_link
    if config.peers_from_kubernetes is None or link is None:
        return None
    from gateway.discovery.k8s import default_namespace
    from gateway.discovery.peer_pods import PeerPodDiscovery  # kubernetes: a heavy import

    assert config.peer_port is not None  # GatewayConfig checks
    namespace = config.k8s_namespace or default_namespace()
    found = PeerPodDiscovery(namespace, config.peers_from_kubernetes, config.peer_port)

    async def on_peers(peers: frozenset[str]) -> None:
        link.set_peers(peers)

    return asyncio.create_task(found.run(on_peers), name="kvgate-peer-discovery")


def create_app(config: GatewayConfig, discovery: Discovery | None = None) -> FastAPI:
    if discovery is None and config.discovery == "static" and not config.workers:
        log.warning(
            "no workers: start the gateway with --workers URL[,URL] (or --discovery k8s); "
            "until then every request is answered 503"
        )
    discovery = discovery or build_discovery(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = GatewayState.build(config, app.state.streams)
        app.state.gateway = state
        if state.peer_link is not None:
            await state.peer_link.start()
        epp = None
        if config.epp:
            from gateway.epp import EppServer  # grpc: loaded only in EPP mode

            epp = app.state.epp = EppServer(state, config.host, config.epp_port)
            await epp.start()

        async def on_change(workers: frozenset[WorkerEndpoint]) -> None:
            await state.replicas.set_workers(workers)
            if epp is not None:
                await epp.mark_synced()

        task = asyncio.create_task(discovery.run(on_change))
        peers_task = _find_peers(config, state)
        try:
            yield
        finally:
            await cancel_and_wait(task)
            if peers_task is not None:
                await cancel_and_wait(peers_task)
            if epp is not None:
                await epp.stop()  # bounded: gateway/epp/server.py
            await state.close()

    app = GatewayApp(title="kvgate gateway", lifespan=lifespan)
    app.admin_port = config.admin_port
    app.state.streams = OpenStreams()  # the relayed streams a drain cuts (gateway/http/drain.py)
    attach_routes(app)
    return app
