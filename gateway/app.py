"""create_app(config): the FastAPI app with its state; the lifespan runs discovery and pollers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from gateway.api import attach_routes
from gateway.config import GatewayConfig
from gateway.discovery import Discovery
from gateway.discovery.static import StaticDiscovery
from gateway.state import GatewayState

log = logging.getLogger(__name__)


def build_discovery(config: GatewayConfig) -> Discovery:
    if config.discovery == "k8s":
        from gateway.discovery.k8s import KubernetesDiscovery  # kubernetes is a heavy import

        return KubernetesDiscovery(
            config.k8s_namespace or "",
            config.k8s_selector,
            config.k8s_port_name,
            service=config.k8s_service,
        )
    return StaticDiscovery(config.workers)


def create_app(config: GatewayConfig, discovery: Discovery | None = None) -> FastAPI:
    if discovery is None and config.discovery == "static" and not config.workers:
        log.warning(
            "no workers: start the gateway with --workers URL[,URL] (or --discovery k8s); "
            "until then every request is answered 503"
        )
    discovery = discovery or build_discovery(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = GatewayState.build(config)
        app.state.gateway = state
        task = asyncio.create_task(discovery.run(state.replicas.set_urls))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            await state.close()

    app = FastAPI(title="kvgate gateway", lifespan=lifespan)
    attach_routes(app)
    return app
