"""cache_aware: the replica with the lowest estimated cost of serving the request now wins.

The cost is a sum of named terms, in seconds at the candidates' median measured prefill rate
(`Replica.prefill_rate`, from the workers' own metrics; `fleet_rate` says why not each one's):

  queue        prefill tokens ahead of it there: this gateway's requests routed there that have
               no first token yet
  prefill      its own uncached prompt tokens there (the index match)
  interference its uncached tokens again for each request on the replica and for the next
               one to arrive there: its prefill steps are their steps too (decode load)
  spread       recent uncached prefill routed there (decayed), times a small weight: spreads
               new prefixes over the caches even when nothing is in flight
  adapter      LoRA requests only: what `--lora-weight` more uncached prompt blocks would cost
               (prefill and interference), times 0 when the adapter is resident, 0.5 when a slot
               is free, 1 when loading it evicts another (gateway/adapters.py): keeps an
               adapter's requests on the replicas that hold it

queue + prefill is its time to first token; interference is what it costs the others. A longer
prefix wins until the queue behind it costs more than recomputing it elsewhere: that is a spill
(`kvgate_route_spills_total`, counted by the request path). docs/gateway.md has the model.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
from dataclasses import dataclass

from gateway.adapters import adapter_miss
from gateway.config import GatewayConfig
from gateway.policies.base import RouteContext, tie_order
from gateway.replica import Replica

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Cost:
    """Estimated seconds; the total is the sum of the terms (a new term joins as a field)."""

    queue: float
    prefill: float
    interference: float
    spread: float
    adapter: float = 0.0

    @property
    def total(self) -> float:
        return self.queue + self.prefill + self.interference + self.spread + self.adapter


class CacheAwarePolicy:
    name = "cache_aware"

    def __init__(self, config: GatewayConfig) -> None:
        self.w = config.weights
        self.temperature = config.softmax_temperature
        self.half_life = config.recent_half_life
        self.lora_ttl = config.speculative_ttl
        self._rng = random.Random()

    def cost(self, ctx: RouteContext, r: Replica, now: float, rate: float) -> Cost:
        bs = ctx.block_size
        uncached = max(ctx.num_prompt_tokens - ctx.matched.get(r.id, 0) * bs, 0)
        # The worker's own counts see other gateways' requests too.
        on_replica = max(r.in_flight, r.running + r.waiting)
        adapter = 0.0
        if ctx.lora_name is not None:
            # Priced as that many uncached prompt blocks: its prefill plus its interference.
            miss = adapter_miss(r, ctx.lora_name, now, self.lora_ttl)
            adapter = rate * self.w.lora * bs * miss * (on_replica + 2)
        return Cost(
            queue=rate * r.in_flight_prefill_tokens,
            prefill=rate * uncached,
            interference=rate * uncached * (on_replica + 1),
            spread=rate * self.w.recent * r.recent_prefill_at(now, self.half_life),
            adapter=adapter,
        )

    async def rank(self, ctx: RouteContext) -> list[Replica]:
        now = time.monotonic()
        rate = fleet_rate(ctx.candidates)
        scored = sorted(
            (
                (self.cost(ctx, r, now, rate).total, tie_order(ctx.tie_seed, r), r)
                for r in ctx.candidates
            ),
            key=lambda t: (t[0], t[1]),
        )
        ranked = [r for _, _, r in scored]
        if log.isEnabledFor(logging.DEBUG):
            log.debug("cache_aware %d prompt tokens: %s", ctx.num_prompt_tokens, explain(self, ctx))
        if self.temperature > 0 and len(ranked) > 1:
            best = scored[0][0]
            weights = [math.exp(-(c - best) / self.temperature) for c, _, _ in scored]
            first = self._rng.choices(range(len(ranked)), weights=weights)[0]
            ranked.insert(0, ranked.pop(first))
        return ranked


def explain(policy: CacheAwarePolicy, ctx: RouteContext) -> str:
    """Each candidate's cost terms, cheapest first (for `--log-level debug`): in milliseconds,
    or in tokens while no replica's prefill rate is measured yet."""
    now, rate = time.monotonic(), fleet_rate(ctx.candidates)
    measured = any(r.prefill_rate.seconds_per_token for r in ctx.candidates)
    unit, scale = ("ms", 1e3) if measured else ("tokens", 1.0)
    costs = sorted(
        ((policy.cost(ctx, r, now, rate), r) for r in ctx.candidates), key=lambda t: t[0].total
    )
    return f"({unit}) " + "; ".join(
        f"{r.id} total={c.total * scale:.0f} queue={c.queue * scale:.0f}"
        f" prefill={c.prefill * scale:.0f} interference={c.interference * scale:.0f}"
        f" spread={c.spread * scale:.0f} adapter={c.adapter * scale:.0f}"
        f" in_flight={r.in_flight} running={r.running} waiting={r.waiting}"
        for c, r in costs
    )


def fleet_rate(replicas: list[Replica]) -> float:
    """Seconds per prompt token for every candidate: the median of their measured rates; with
    none measured, 1 (costs are then in tokens).

    One rate for all, not each replica's own: a replica's measured rate is its prefills' time
    over the tokens they computed, and each prefill also pays a floor (at least one engine step)
    whatever it computes. A replica serving cache hits computes few tokens per request, so its
    rate reads several times higher than an equal replica's that takes new prefixes; at its own
    rate every new prefix would then go to the replica that took the last ones, until its cache
    overflows. The median keeps the costs in seconds without that feedback."""
    measured = [
        r.prefill_rate.seconds_per_token for r in replicas if r.prefill_rate.seconds_per_token
    ]
    return statistics.median(measured) if measured else 1.0
