"""round_robin: each request starts one replica further along the (sorted) replica list."""

from __future__ import annotations

import itertools

from gateway.config import GatewayConfig
from gateway.fleet.replica import Replica
from gateway.routing.policies.base import RouteContext


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self, config: GatewayConfig) -> None:
        self._counter = itertools.count()

    def rank(self, ctx: RouteContext) -> list[Replica]:
        reps = sorted(ctx.candidates, key=lambda r: r.id)
        i = next(self._counter) % len(reps)
        return reps[i:] + reps[:i]
