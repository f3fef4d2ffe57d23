"""cache_aware: the replica with the lowest estimated cost of serving the request now wins.

The cost is a sum of named terms in seconds (`Cost`, fleet_cost.py). Once the gateway has timed
enough requests, they are a learned latency model's predictions (gateway/fleet/latency.py: time
to first token and whole time against the load a request was sent into, fitted from every
candidate's samples pooled, `fleet_model`, and applied to each candidate's own load):

  queue        what the requests there add to its first token: per request there (the
               gateway's in flight and what else the worker counts, `requests_there`), per
               request and per prefill token queued there (the gateway's without a first
               token yet)
  prefill      the model's base plus its own uncached prompt tokens there (the index match),
               plus the copy of the tokens its host tier serves (`copy`, below); a token at the
               fit's marginal price (`learned_rate`: not the workers' measured prefill rate,
               which smears each prefill's step over its few computed tokens)
  interference the slowdown it causes the requests already there: each is delayed by what one
               more request arriving adds to a request's whole time there
               (`FleetFit.slowdown`: its queued prefill's step, then one more stream) and by
               its uncached tokens' prefill
  load         the slowdown the requests there cause it past its first token, alike: each is
               a stream whose next turn comes back to the replica holding its prefix, each
               arrival stalling this request's steps by `slowdown` (less the TTFT's own
               per-request time, which `queue` prices). The price of imbalance: a replica with
               one more request than another costs about two `slowdown`s more, which outweighs
               a hit that saves less (a cheap hit: a worker without server cost, a short
               prompt); a long prompt's hit still wins
  evict        what its uncached prompt pushes out of a full cache (`evicted_tokens`: the
               blocks it needs beyond the replica's free ones, the index's count of what it
               holds against the size its worker reports), each token priced as one uncached
               token times `--evict-weight` (1): a full LRU cache gives up blocks that a later
               request may ask for and recompute. A spill onto a replica with room costs its
               own recompute; onto a full one, that and what it displaces. Without it the
               docs' workload's 12 prefixes, 2.8 caches' worth over 4, were spread by every
               imbalance until each replica's cache churned (52-54% hit; with it 75%;
               docs/benchmarks.md, step 7). On a worker with a host tier the GPU's evicted
               blocks move there: each token costs the copy back instead, and those the tier
               drops for room (`dropped_tokens`) a recompute less the copy
  spread, adapter, busy as below, at the learned seconds per uncached token

Until then (no replica fitted), the terms are priced in prompt tokens at the candidates' median
measured prefill rate (`Replica.prefill_rate`, from the workers' own metrics; `fleet_rate` says
why not each one's):

  queue        prefill tokens ahead of it there: this gateway's requests routed there that have
               no first token yet
  prefill      its own uncached prompt tokens there (the index match), plus the copy of
               those its host tier serves: at the replica's measured copy rate, or at
               `PRIOR_RATIO` of a computed token's (gateway/fleet/copy_rate.py)
  interference its uncached tokens again for each request on the replica and for the next
               one to arrive there: its prefill steps are their steps too (decode load)
  spread       recent uncached prefill routed there (decayed), times a small weight: spreads
               new prefixes over the caches even when nothing is in flight
  adapter      LoRA requests only: what `--lora-weight` more uncached prompt blocks would cost
               (prefill and interference), times 0 when the adapter is resident, 0.5 when a slot
               is free, 1 when loading it evicts another (gateway/routing/adapters.py): keeps an
               adapter's requests on the replicas that hold it
  evict        as above, in tokens
  busy         a holder's requests in flight that share this request's prefix
               (gateway/fleet/prefix_load.py) beyond `BUSY_SLACK`, each charged the tokens
               the replica holds of the request, times `--busy-weight` (0.5): Dynamo's charge
               for the context a replica serves, counted only for this prefix's own traffic
               (charging all the load there moved distinct tenants off their holders). It makes
               a hot prefix gain holders as its load grows (docs/gateway.md), from the first
               request on; a new holder keeps the prefix, so it does not move back and forth

queue + prefill is its time to first token; interference is what it costs the others, load
what the others cost it past that. A longer
prefix wins until the queue behind it costs more than recomputing it elsewhere: that is a spill
(`kvgate_route_spills_total`, counted by the request path). docs/gateway.md has the model.

Candidates that cannot win cost nothing: an idle replica holding no prefix of the request (no
request in flight, none queued or running there) costs every such request the same 2 x its
prompt plus its recent prefill, so of those only the `TOP` with the least recent prefill are
costed. With hundreds of replicas the first `TOP` places are exact and the rest follow in no
particular order (retries and the EPP's fallbacks take the first few).
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import time

from gateway.config import GatewayConfig
from gateway.fleet.copy_rate import copy_seconds_per_token
from gateway.fleet.latency import FleetFit
from gateway.fleet.prefix_load import sharing
from gateway.fleet.replica import Replica
from gateway.routing.adapters import adapter_miss
from gateway.routing.policies.base import RouteContext, tie_order
from gateway.routing.policies.fleet_cost import (
    Cost,
    dropped_tokens,
    evicted_tokens,
    eviction_seconds,
    fleet_model,
    fleet_rate,
    learned_rate,
    measured_rate,
)

__all__ = ["CacheAwarePolicy", "Cost", "explain", "fleet_rate", "quietest"]

log = logging.getLogger(__name__)

TOP = 8  # places ranked exactly when most candidates are idle and hold nothing of the request
POOL_TTL = 0.25  # seconds a pooled fit is reused for the same candidates
BUSY_SLACK = 2  # requests sharing the prefix a holder may serve before the busy term charges


class CacheAwarePolicy:
    name = "cache_aware"

    def __init__(self, config: GatewayConfig) -> None:
        self.w = config.weights
        self.temperature = config.softmax_temperature
        self.half_life = config.recent_half_life
        self.lora_ttl = config.speculative_ttl
        self._rng = random.Random()
        self._pool: tuple[tuple[int, int], float, FleetFit | None] = ((0, 0), -1.0, None)

    def cost(
        self,
        ctx: RouteContext,
        r: Replica,
        now: float,
        rate: float,
        fleet: FleetFit | None = None,
        floor: float = 0.0,
    ) -> Cost:
        """Its cost on `r`: predicted by `fleet` (the candidates' pooled latency fit) at `r`'s
        load, or without one in prompt tokens at `rate`. `floor`: the least the learned model
        may price an uncached token at (the workers' measured prefill rate)."""
        bs = ctx.block_size
        blocks = ctx.matched.get(r.id, 0)
        uncached = max(ctx.num_prompt_tokens - blocks * bs, 0)
        on_replica = r.requests_there()  # the worker's own counts see other gateways' too
        if fleet is not None:
            rate = learned_rate(fleet, floor)
        # A host-tier token copied back: at its measured seconds once it is timed.
        measured = r.copy_rate.seconds_per_token if floor or fleet is not None else None
        copy = 0.0
        if ctx.host and (host := ctx.host.get(r.id)):  # its host tier serves part of the hit
            copy = host * bs * copy_seconds_per_token(measured, rate)
        adapter = 0.0
        if ctx.lora_name is not None:
            # Priced as that many uncached prompt blocks: its prefill plus its interference.
            miss = adapter_miss(r, ctx.lora_name, now, self.lora_ttl)
            adapter = rate * self.w.lora * bs * miss * (on_replica + 2)
        spread = rate * self.w.recent * r.recent_prefill_at(now, self.half_life)
        busy = self._busy(ctx, r, blocks, rate)
        evict = self._evict(ctx, r, uncached, rate, measured)
        if fleet is not None:
            c = fleet.ttft
            return Cost(
                queue=c.per_queued * r.in_flight_prefill_tokens
                + c.per_waiting * r.in_flight_prefills
                + c.per_request * on_replica,
                prefill=c.base + rate * uncached + copy,
                interference=on_replica * (fleet.slowdown + rate * uncached + copy),
                spread=spread,
                adapter=adapter,
                busy=busy,
                load=on_replica * max(fleet.slowdown - c.per_request, 0.0),
                evict=evict,
            )
        return Cost(
            queue=rate * r.in_flight_prefill_tokens,
            prefill=rate * uncached + copy,
            interference=(rate * uncached + copy) * (on_replica + 1),
            spread=spread,
            adapter=adapter,
            busy=busy,
            evict=evict,
        )

    def _busy(self, ctx: RouteContext, r: Replica, blocks: int, rate: float) -> float:
        """The prefill time of the tokens `r` holds of the request, per request in flight there
        sharing its prefix beyond `BUSY_SLACK`, times `--busy-weight`."""
        if not blocks or not self.w.busy:
            return 0.0
        over = sharing(r.in_flight_prefixes, ctx.keys, blocks) - BUSY_SLACK
        held = min(blocks * ctx.block_size, ctx.num_prompt_tokens)
        return rate * self.w.busy * over * held if over > 0 else 0.0

    def _evict(
        self, ctx: RouteContext, r: Replica, uncached: int, rate: float, measured: float | None
    ) -> float:
        """What the cached tokens `uncached` pushes out of `r`'s GPU cache cost later requests
        (lost, or moved to its host tier: copied back at `measured`), times `--evict-weight`."""
        gone = evicted_tokens(r, uncached, ctx.block_size, ctx.cached_blocks) if self.w.evict else 0
        if not gone:
            return 0.0
        dropped = dropped_tokens(r, gone, ctx.block_size, ctx.host_blocks)
        copy_rate = copy_seconds_per_token(measured, rate) if dropped is not None else 0.0
        return self.w.evict * eviction_seconds(gone, dropped, rate, copy_rate)

    def rank(self, ctx: RouteContext) -> list[Replica]:
        now = time.monotonic()
        floor, fleet = measured_rate(ctx.candidates), self.fleet_model(ctx.candidates, now)
        rate = floor or 1.0
        exact = self.temperature > 0 or ctx.lora_name is not None or len(ctx.candidates) <= 2 * TOP
        contenders = ctx.candidates if exact else self._contenders(ctx)
        scored = sorted(
            (
                (
                    self.cost(ctx, r, now, rate, fleet, floor).total,
                    tie_order(ctx.tie_seed, r),
                    r,
                )
                for r in contenders
            ),
            key=lambda t: (t[0], t[1]),
        )
        ranked = [r for _, _, r in scored]
        if not exact:
            first = {id(r) for r in ranked[:TOP]}
            ranked = ranked[:TOP] + [r for r in ctx.candidates if id(r) not in first]
        if log.isEnabledFor(logging.DEBUG):
            log.debug("cache_aware %d prompt tokens: %s", ctx.num_prompt_tokens, explain(self, ctx))
        if self.temperature > 0 and len(ranked) > 1:
            best = scored[0][0]
            weights = [math.exp(-(c - best) / self.temperature) for c, _, _ in scored]
            first = self._rng.choices(range(len(ranked)), weights=weights)[0]
            ranked.insert(0, ranked.pop(first))
        return ranked

    def fleet_model(self, candidates: list[Replica], now: float) -> FleetFit | None:
        """The pooled fit of (up to `FLEET_SAMPLE` of) the fitted candidates, reused for
        `POOL_TTL` while the candidates look the same (it changes only with new samples)."""
        key = (len(candidates), id(candidates[0]))
        cached_key, at, coefs = self._pool
        if cached_key == key and now - at < POOL_TTL:
            return coefs
        coefs = fleet_model(candidates)
        self._pool = (key, now, coefs)
        for r in candidates:  # what their requests are expected to take (latency.py)
            r.latency.pool = coefs.ttft if coefs is not None else None
        return coefs

    def _contenders(self, ctx: RouteContext) -> list[Replica]:
        """The candidates that may be among the `TOP` cheapest: those holding a prefix of the
        request or with work there, and the `TOP` idle ones with the least recent prefill."""
        matched, busy, idle = ctx.matched, [], []
        for r in ctx.candidates:
            if (
                r.in_flight
                or r.in_flight_prefill_tokens
                or r.running
                or r.waiting
                or r.id in matched
            ):
                busy.append(r)
            else:
                idle.append(r)
        return busy + quietest(idle, TOP, ctx.tie_seed)


def quietest(idle: list[Replica], k: int, seed: bytes) -> list[Replica]:
    """The `k` replicas with the least recent prefill now (`Replica.recent_key` orders them
    at any time), ties in rendezvous order; only a tie at the k-th place is hashed."""
    if len(idle) <= k:
        return idle
    kth = heapq.nsmallest(k, (r.recent_key for r in idle))[-1]
    below = [r for r in idle if r.recent_key < kth]
    tied = sorted((r for r in idle if r.recent_key == kth), key=lambda r: tie_order(seed, r))
    return below + tied[: k - len(below)]


def explain(policy: CacheAwarePolicy, ctx: RouteContext) -> str:
    """Each candidate's cost terms, cheapest first (for `--log-level debug`): in milliseconds,
    or in tokens while no replica's prefill rate is measured and no latency model is fitted;
    with a model, whose it is (own or fleet) and its mean relative error so far."""
    now, floor, fleet = time.monotonic(), measured_rate(ctx.candidates), fleet_model(ctx.candidates)
    unit, scale = ("ms", 1e3) if floor or fleet is not None else ("tokens", 1.0)
    costs = sorted(
        ((policy.cost(ctx, r, now, floor or 1.0, fleet, floor), r) for r in ctx.candidates),
        key=lambda t: t[0].total,
    )
    return f"({unit}) {fit_note(fleet, floor)}" + "; ".join(
        f"{r.id} total={c.total * scale:.0f} queue={c.queue * scale:.0f}"
        f" prefill={c.prefill * scale:.0f} interference={c.interference * scale:.0f}"
        f" load={c.load * scale:.0f} spread={c.spread * scale:.0f}"
        f" adapter={c.adapter * scale:.0f} busy={c.busy * scale:.0f} evict={c.evict * scale:.0f}"
        f" sharing={sharing(r.in_flight_prefixes, ctx.keys, ctx.matched.get(r.id, 0))}"
        f" in_flight={r.in_flight} running={r.running} waiting={r.waiting}"
        f"{model_note(r, fleet)}"
        for c, r in costs
    )


def fit_note(fleet: FleetFit | None, floor: float) -> str:
    """The pooled fit the costs come from (nothing before one): its terms in ms (a token's in
    us), the learned token price, and the workers' measured prefill rate it is floored by."""
    if fleet is None:
        return ""
    c = fleet.ttft
    return (
        f"[fit base={c.base * 1e3:.1f} per_request={c.per_request * 1e3:.1f}"
        f" per_waiting={c.per_waiting * 1e3:.1f} slowdown={fleet.slowdown * 1e3:.1f}"
        f" per_token={learned_rate(fleet, floor) * 1e6:.1f}us"
        f" per_queued={c.per_queued * 1e6:.1f}us measured={floor * 1e6:.1f}us] "
    )


def model_note(r: Replica, fleet: FleetFit | None) -> str:
    """The learned model's word on `r`: the pooled fit's prediction of its TTFT, and its own
    fit's error so far (and samples)."""
    if fleet is None:
        return ""
    m = r.latency
    return (
        f" model=fleet samples={m.samples} error={m.mean_error:.0%}"
        if m.fitted
        else (f" model=fleet samples={m.samples}")
    )
