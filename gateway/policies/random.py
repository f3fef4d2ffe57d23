"""random: a uniformly random order (a baseline)."""

from __future__ import annotations

import random

from gateway.config import GatewayConfig
from gateway.policies.base import RouteContext
from gateway.replica import Replica


class RandomPolicy:
    name = "random"

    def __init__(self, config: GatewayConfig) -> None:
        self._rng = random.Random()

    async def rank(self, ctx: RouteContext) -> list[Replica]:
        reps = list(ctx.candidates)
        self._rng.shuffle(reps)
        return reps
