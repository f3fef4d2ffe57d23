"""least_loaded: fewest in-flight plus queued requests, then lowest KV usage."""

from __future__ import annotations

from gateway.config import GatewayConfig
from gateway.fleet.replica import Replica
from gateway.routing.policies.base import RouteContext, tie_order


class LeastLoadedPolicy:
    name = "least_loaded"

    def __init__(self, config: GatewayConfig) -> None:
        pass

    def rank(self, ctx: RouteContext) -> list[Replica]:
        return sorted(
            ctx.candidates,
            key=lambda r: (r.in_flight + r.waiting, r.kv_usage, tie_order(ctx.tie_seed, r)),
        )
