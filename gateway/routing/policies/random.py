"""random: a uniformly random order (a baseline)."""

from __future__ import annotations

import random

from gateway.config import GatewayConfig
from gateway.fleet.replica import Replica
from gateway.routing.policies.base import RouteContext


class RandomPolicy:
    name = "random"

    def __init__(self, config: GatewayConfig) -> None:
        self._rng = random.Random()

    def rank(self, ctx: RouteContext) -> list[Replica]:
        reps = list(ctx.candidates)
        self._rng.shuffle(reps)
        return reps
