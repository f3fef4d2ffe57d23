"""cache_aware's price of imbalance (gateway/routing/policies/cache_aware.py, `load`): with the
latency laws the calibrated sim without server cost shows (docs/benchmarks.md, *Routing in the
calibrated sim*, step 6), a replica with more requests there loses to an idle one despite a
cheap hit, a big hit still wins, and the workers' measured prefill rate no longer prices a
token above what the fleet's timings say it costs."""

from __future__ import annotations

import pytest

from cachekey.keys import HashNamespace, block_keys
from gateway.config import GatewayConfig
from gateway.fleet.replica import Replica
from gateway.routing.policies import POLICIES, RouteContext
from gateway.routing.policies.cache_aware import explain
from gateway.routing.policies.fleet_cost import TIE_SHARE, fleet_model
from tests.support.latency_laws import fleet

NS = HashNamespace("demo", 16)


def ctx_for(reps: list[Replica], prompt: int, held: int) -> RouteContext:
    """A `prompt`-token request of which w0 holds `held` tokens."""
    keys = block_keys(list(range(prompt)), NS)
    return RouteContext(reps, keys, prompt, 16, {reps[0].id: held // 16}, {}, keys[0])


def test_the_learned_slowdown_is_a_queued_prefill_and_a_request_there():
    reps = fleet()
    fit = fleet_model(reps)
    assert fit is not None
    assert fit.ttft.per_request < 0.005  # the TTFT law has none
    assert fit.slowdown == pytest.approx(0.060, rel=0.15)  # the whole-time law's queued prefill


def test_a_busier_holder_loses_to_an_idle_replica_despite_a_cheap_hit():
    """2,600 tokens, 2,400 held: the hit saves 2,200 x 27 us, about 60 ms of prefill. One
    request there costs it about 60 ms of its own time past its first token (`load`) and 60 ms
    of the other's (`interference`): the idle replica wins."""
    reps = fleet()
    policy = POLICIES["cache_aware"](GatewayConfig())
    ctx = ctx_for(reps, 2600, 2400)
    assert policy.rank(ctx)[0] is reps[0]  # all idle: the hit wins
    for there in (1, 2):
        reps[0].in_flight = there
        assert policy.rank(ctx)[0] is not reps[0]
        holder = policy.cost(ctx, reps[0], 0.0, 1.0, fleet_model(reps), 150e-6)
        assert holder.load == pytest.approx(there * 0.060, rel=0.15)
    idle = policy.cost(ctx, reps[1], 0.0, 1.0, fleet_model(reps), 150e-6)
    assert idle.load == 0.0
    assert " load=0 " in explain(policy, ctx).split("; ")[0]  # the winner, idle, explained
    assert " load=121 " in explain(policy, ctx)  # the holder's two requests, in ms


def test_a_big_hit_still_wins_on_the_busier_holder():
    """16,000 tokens, 15,200 held: the hit saves about 390 ms of prefill, and the idle replica's
    recompute would stall nothing but itself; still the holder with two requests wins."""
    reps = fleet()
    policy = POLICIES["cache_aware"](GatewayConfig())
    reps[0].in_flight = 2
    assert policy.rank(ctx_for(reps, 16000, 15200))[0] is reps[0]


def test_the_measured_prefill_rate_does_not_price_a_token_above_the_learned_one():
    """The fleet measures 150 us a token (each prefill's step over few tokens); its timings say
    27 us. A miss is priced at the learned rate; the measured one only floors it at
    `TIE_SHARE`."""
    reps = fleet()
    policy = POLICIES["cache_aware"](GatewayConfig())
    ctx = ctx_for(reps, 2600, 0)
    cold = policy.cost(ctx, reps[1], 0.0, 1.0, fleet_model(reps), 150e-6)
    assert cold.prefill == pytest.approx(0.070 + 2600 * 27e-6, rel=0.05)
    assert TIE_SHARE * 150e-6 < 27e-6
