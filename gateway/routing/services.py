"""What a routing decision reads and changes, as the routing floor declares it.

The app's `GatewayState` (gateway/state.py, a floor above) is one; routing never imports it, so
what routing depends on is written here, once, and the state is passed in.
"""

from __future__ import annotations

from typing import Protocol

from cachekey.render import Renderer
from gateway.config import GatewayConfig
from gateway.fleet.breaker import CircuitBreaker
from gateway.fleet.replica_set import ReplicaSet
from gateway.images.fetch import ImageFetcher, RemoteImagesDisabled
from gateway.index.block_index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.routing.admission import Admission, RenderQueue
from gateway.routing.policies import Policy


class RouteServices(Protocol):
    """The gateway's parts one request's routing uses, from its policy to its release."""

    config: GatewayConfig
    metrics: GatewayMetrics
    index: BlockIndex
    replicas: ReplicaSet
    policies: dict[str, Policy]
    fetcher: ImageFetcher | RemoteImagesDisabled
    admission: Admission
    breaker: CircuitBreaker
    render_queue: RenderQueue

    async def get_renderer(self) -> Renderer: ...
