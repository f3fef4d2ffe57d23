"""The per-replica latency model (gateway/fleet/latency.py) and cache_aware pricing with it: it
learns a replica's TTFT law from samples, follows a replica that slows down, and a hot prefix
whose holder is busier than a cold replica with the recompute gets another holder."""

from __future__ import annotations

import random

import pytest

from cachekey.keys import HashNamespace, block_keys
from gateway.config import GatewayConfig
from gateway.fleet.latency import MIN_SAMPLES, LatencyModel, features, pooled
from gateway.fleet.replica import Replica
from gateway.names import ReplicaId
from gateway.routing.policies import POLICIES, RouteContext
from gateway.routing.policies.cache_aware import explain

NS = HashNamespace("demo", 16)


def law(uncached: int, queued: int, waiting: int, there: int, slow: float = 1.0) -> float:
    """A worker's TTFT: 12 ms, 35 us per uncached token, 3 us per queued token, 30 ms per
    request queued, 50 ms per request there."""
    return slow * (0.012 + 35e-6 * uncached + 3e-6 * queued + 0.03 * waiting + 0.05 * there)


def train(model: LatencyModel, n: int, rng: random.Random, slow: float = 1.0) -> None:
    for _ in range(n):
        u, q, k = rng.randrange(0, 2600), rng.randrange(0, 6000), rng.randrange(0, 9)
        w = rng.randrange(0, k + 1)
        seconds = law(u, q, w, k, slow) * rng.uniform(0.9, 1.1)  # the host's noise
        model.observe(features(u, q, w, k), seconds, None)


def test_model_learns_a_replicas_ttft_law_from_its_samples():
    model, rng = LatencyModel(), random.Random(1)
    train(model, MIN_SAMPLES - 1, rng)
    assert not model.fitted
    train(model, 400, rng)
    c = model.coefficients()
    assert model.fitted
    assert c.per_token == pytest.approx(35e-6, rel=0.1)
    assert c.per_request == pytest.approx(0.05, rel=0.1)
    assert c.per_waiting == pytest.approx(0.03, rel=0.2)
    for load in [(2600, 0, 0, 0), (100, 2000, 2, 4), (1500, 5000, 8, 8)]:
        assert c.ttft(*load) == pytest.approx(law(*load), rel=0.1)


def test_model_follows_a_replica_that_slows_down_and_reports_its_error():
    model, rng = LatencyModel(), random.Random(2)
    train(model, 300, rng)
    before = model.coefficients().ttft(2000, 0, 1, 4)
    model.pool = model.coefficients()  # what the router prices it with
    sample = model.start(2000, 0, 1, 4)  # expected now: the old law
    assert sample.expected == pytest.approx(before)
    train(model, 600, rng, slow=2.0)
    assert model.coefficients().ttft(2000, 0, 1, 4) == pytest.approx(2 * before, rel=0.1)
    # The error of predictions made while it changed: smoothed, relative.
    model.observe(features(2000, 0, 1, 4), 2 * before, before)
    assert 0 < model.mean_error < 0.5


def test_pooled_fit_separates_what_each_replica_alone_cannot():
    """A replica always busy (8 requests there) cannot tell its base from its per-request time,
    nor one always idle its per-request time; their samples pooled can."""
    rng = random.Random(3)
    busy, idle = LatencyModel(), LatencyModel()
    for model, there in ((busy, 8), (idle, 0)):
        for _ in range(300):
            u, q, w = rng.randrange(0, 2600), rng.randrange(0, 6000), rng.randrange(0, 3)
            model.observe(features(u, q, w, there), law(u, q, w, there), None)
    assert idle.coefficients().per_request < 0.001  # never saw a request there
    assert busy.coefficients().base < 0.7 * 0.012  # the ridge split its base with the requests
    both = pooled([busy, idle, LatencyModel()])
    assert both is not None and both.per_request == pytest.approx(0.05, rel=0.05)
    assert both.base == pytest.approx(0.012, rel=0.1)
    assert pooled([LatencyModel()]) is None


def _fleet(n: int = 4) -> list[Replica]:
    reps = [Replica(ReplicaId(f"http://w{i}"), f"http://w{i}", healthy=True) for i in range(n)]
    rng = random.Random(4)
    for r in reps:
        train(r.latency, 300, rng)
    return reps


def _ctx(reps: list[Replica], tokens: list[int], matched: dict) -> RouteContext:
    keys = block_keys(tokens, NS)
    return RouteContext(reps, keys, len(tokens), 16, matched, {}, keys[0])


def test_a_hot_prefix_gets_another_holder_when_its_holder_is_busier_than_a_recompute():
    """By the law above a recompute of 2,400 tokens costs 84 ms, and as much again to the one
    request already on a replica that takes it. A request there costs the new one 50 ms to its
    first token and 30 ms more after (`load`), and a request arriving costs each one there 80 ms
    (30 queued, then 50 there: `slowdown`): one more request on the holder than elsewhere
    outweighs the recompute."""
    reps = _fleet()
    policy = POLICIES["cache_aware"](GatewayConfig())
    tokens = list(range(2592))  # 162 blocks
    ctx = _ctx(reps, tokens, {reps[0].id: 150})
    for r in reps:
        r.in_flight = 1
    assert policy.rank(ctx)[0] is reps[0]  # as busy as the others: the hit wins
    reps[0].in_flight = 2
    first = policy.rank(ctx)[0]
    assert first is not reps[0]  # one more there does not: another replica takes the prefix
    # Unfitted (no samples yet), the token-priced model keeps it on the holder.
    cold = [Replica(r.id, r.url, healthy=True, in_flight=r.in_flight) for r in reps]
    assert policy.rank(_ctx(cold, tokens, {cold[0].id: 150}))[0] is cold[0]
    # Once that replica holds the prefix too, its traffic goes to the less busy holder, not to
    # a third replica, and back when that one is the busier.
    ctx.matched[first.id] = 150
    for r in reps:
        r.in_flight = 2 if r.id not in ctx.matched else r.in_flight
    assert policy.rank(ctx)[0] is first
    first.in_flight = 5
    assert policy.rank(ctx)[0] is reps[0]


def test_replicas_without_samples_are_priced_by_the_pooled_fit_and_explained():
    reps = _fleet(3)
    newcomer = Replica(ReplicaId("http://w9"), "http://w9", healthy=True)
    reps.append(newcomer)
    for r in reps[:3]:
        r.in_flight = 4
    policy = POLICIES["cache_aware"](GatewayConfig())
    ctx = _ctx(reps, list(range(320)), {})
    assert policy.rank(ctx)[0] is newcomer  # priced by the fleet's fit: idle, so cheapest
    assert newcomer.latency.pool is not None  # its requests are expected by that fit
    text = explain(policy, ctx)
    assert text.startswith("(ms) [fit base=") and "slowdown=" in text  # the pooled fit's terms
    assert "] http://w9 " in text and "model=fleet samples=0" in text.split("; ")[0]
    assert "model=fleet samples=300 error=" in text.split("; ")[1]


def test_a_hit_still_wins_where_the_learned_recompute_costs_nothing():
    """A worker whose TTFT does not grow with uncached tokens (a sim worker without timings):
    the measured prefill rate floors the learned per-token price, so the holder wins."""
    reps = [Replica(ReplicaId(f"http://w{i}"), f"http://w{i}", healthy=True) for i in range(4)]
    rng = random.Random(5)
    for r in reps:
        for _ in range(100):
            k = rng.randrange(0, 4)
            x = features(rng.randrange(0, 2600), 0, 0, k)
            r.latency.observe(x, 0.004 + 0.001 * k, None)
        r.prefill_rate.seconds_per_token = 1e-6
    assert reps[0].latency.coefficients().per_token < 1e-7
    policy = POLICIES["cache_aware"](GatewayConfig())
    for holder in reps:
        ctx = _ctx(reps, list(range(320)), {holder.id: 18})
        assert policy.rank(ctx)[0] is holder
