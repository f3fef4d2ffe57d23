"""cache_aware: lowest cost wins, where cost trades uncached prefill against load.

cost(r) = w_prefill * uncached_prompt_tokens(r) / block_size
        + w_load * (in_flight_uncached_prefill_tokens(r) / block_size + w_decode * in_flight(r))
        + w_queue * waiting(r) + w_kv * kv_usage(r)
        + w_recent * recent_uncached_prefill_tokens(r) / block_size     (decayed)
        + w_lora * adapter_miss(r)          (LoRA requests: 0 resident, 0.5 free slot, 1 full)

The recent term spreads new prefix groups (which miss everywhere) over the replicas even when
nothing is in flight; it is small next to a real prefix hit. The LoRA term keeps an adapter's
requests on the replicas that hold it (gateway/adapters.py).
"""

from __future__ import annotations

import math
import random
import time

from gateway.adapters import adapter_miss
from gateway.config import GatewayConfig
from gateway.policies.base import RouteContext, tie_order
from gateway.replicas import Replica


class CacheAwarePolicy:
    name = "cache_aware"

    def __init__(self, config: GatewayConfig) -> None:
        self.w = config.weights
        self.temperature = config.softmax_temperature
        self.half_life = config.recent_half_life
        self.lora_ttl = config.speculative_ttl
        self._rng = random.Random()

    def cost(self, ctx: RouteContext, r: Replica, now: float) -> float:
        w, bs = self.w, ctx.block_size
        uncached = max(ctx.num_prompt_tokens - ctx.matched.get(r.id, 0) * bs, 0)
        load = r.in_flight_prefill_tokens / bs + w.decode * r.in_flight
        recent = r.recent_prefill_at(now, self.half_life) / bs
        cost = (
            w.prefill * uncached / bs
            + w.load * load
            + w.queue * r.waiting
            + w.kv * r.kv_usage
            + w.recent * recent
        )
        if ctx.lora_name is not None:
            cost += w.lora * adapter_miss(r, ctx.lora_name, now, self.lora_ttl)
        return cost

    async def rank(self, ctx: RouteContext) -> list[Replica]:
        now = time.monotonic()
        scored = sorted(
            ((self.cost(ctx, r, now), tie_order(ctx.tie_seed, r), r) for r in ctx.candidates),
            key=lambda t: (t[0], t[1]),
        )
        ranked = [r for _, _, r in scored]
        if self.temperature > 0 and len(ranked) > 1:
            best = scored[0][0]
            weights = [math.exp(-(c - best) / self.temperature) for c, _, _ in scored]
            first = self._rng.choices(range(len(ranked)), weights=weights)[0]
            ranked.insert(0, ranked.pop(first))
        return ranked
