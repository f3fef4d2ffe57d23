"""cache_aware's price of eviction (gateway/routing/policies/cache_aware.py, `evict`): a
request's uncached prompt on a replica whose cache is full pushes out blocks that a later
request may ask for, so a spill there costs that recompute too. The caches' contents come from
a real BlockIndex fed KV events, their sizes from what the workers report. With the latency
laws of the calibrated sim (tests/support/latency_laws.py), a holder with a request there loses
a 3,800-token hit of a 4,000-token prompt to an idle replica with room (the price of
imbalance, tests/gateway/test_load_price.py: the hit saves about 100 ms, the request there
costs about 125) but keeps it against idle replicas whose caches are full (the recompute
would also evict 4,000 tokens, about 110 ms more); `--evict-weight 0` turns the charge off."""

from __future__ import annotations

import pytest

from cachekey.documents import KVEventsEndpoint
from cachekey.events import BlockStored
from cachekey.keys import HashNamespace, block_keys
from gateway.config import CostWeights, GatewayConfig
from gateway.fleet.ranks import RankSlot
from gateway.fleet.replica import Replica
from gateway.index.block_index import BlockIndex
from gateway.routing.policies import POLICIES, RouteContext
from gateway.routing.policies.cache_aware import explain
from gateway.routing.policies.fleet_cost import evicted_tokens, fleet_model, learned_rate
from tests.support.latency_laws import fleet

NS = HashNamespace("demo", 16)
SIZE = 400  # blocks in each replica's cache


def sized(reps: list[Replica], blocks: int = SIZE) -> None:
    """Each replica's cache holds `blocks` blocks, as its /kvgate/info says."""
    for r in reps:
        r.slot = RankSlot(None, None, None, KVEventsEndpoint(enabled=False), blocks, None)


def fill(index: BlockIndex, r: Replica, blocks: int, first_token: int = 100_000) -> None:
    """`r` reports `blocks` blocks of another prompt stored."""
    tokens = list(range(first_token, first_token + 16 * blocks))
    stored = BlockStored(
        block_hashes=list(range(1, blocks + 1)),
        parent_block_hash=None,
        token_ids=tokens,
        block_size=16,
        extra_keys=[None] * blocks,
    )
    assert index.apply(r.id, NS, [stored]) == 1


def ctx_for(reps: list[Replica], index: BlockIndex, prompt: int, held: int) -> RouteContext:
    """A `prompt`-token request of which w0 holds `held` tokens."""
    keys = block_keys(list(range(prompt)), NS)
    hits = {reps[0].id: held // 16}
    return RouteContext(
        reps, keys, prompt, 16, hits, {}, keys[0], None, {}, index.lookup.replica_blocks
    )


def test_the_evicted_tokens_are_the_blocks_needed_beyond_the_free_ones():
    index = BlockIndex()
    (r,) = fleet()[:1]
    assert evicted_tokens(r, 320, 16, index.lookup.replica_blocks) == 0  # its size unknown
    sized([r], 100)
    assert evicted_tokens(r, 320, 16, None) == 0  # its contents unknown
    assert evicted_tokens(r, 320, 16, index.lookup.replica_blocks) == 0  # empty: room
    fill(index, r, 90)
    assert evicted_tokens(r, 320, 16, index.lookup.replica_blocks) == 10 * 16
    assert evicted_tokens(r, 330, 16, index.lookup.replica_blocks) == 11 * 16  # a part block
    assert evicted_tokens(r, 0, 16, index.lookup.replica_blocks) == 0  # a full hit


def test_a_busier_holder_keeps_a_hit_that_idle_full_replicas_would_recompute():
    reps, index = fleet(), BlockIndex()
    sized(reps)
    policy = POLICIES["cache_aware"](GatewayConfig())
    reps[0].in_flight = 1
    ctx = ctx_for(reps, index, 4000, 3800)
    assert policy.rank(ctx)[0] is not reps[0]  # idle replicas with room: the load decides
    for r in reps[1:]:
        fill(index, r, SIZE)
    assert policy.rank(ctx)[0] is reps[0]  # recomputing it there would evict 4,000 tokens
    fit, floor = fleet_model(reps), 150e-6
    rate = learned_rate(fit, floor)
    idle = policy.cost(ctx, reps[1], 0.0, 1.0, fit, floor)
    assert idle.evict == pytest.approx(rate * 250 * 16)
    holder = policy.cost(ctx, reps[0], 0.0, 1.0, fit, floor)
    assert holder.evict == 0.0  # its 200 uncached tokens fit in its room
    assert " evict=0 " in explain(policy, ctx).split("; ")[0]  # the holder, explained
    fill(index, reps[0], SIZE, first_token=900_000)
    holder = policy.cost(ctx, reps[0], 0.0, 1.0, fit, floor)
    assert holder.evict == pytest.approx(rate * 13 * 16)  # full too: its 13 blocks evict
    assert policy.rank(ctx)[0] is reps[0]


def test_evict_weight_zero_turns_the_charge_off():
    reps, index = fleet(), BlockIndex()
    sized(reps)
    for r in reps[1:]:
        fill(index, r, SIZE)
    policy = POLICIES["cache_aware"](GatewayConfig(weights=CostWeights(evict=0.0)))
    reps[0].in_flight = 1
    ctx = ctx_for(reps, index, 4000, 3800)
    assert policy.rank(ctx)[0] is not reps[0]
    assert policy.cost(ctx, reps[1], 0.0, 1.0, fleet_model(reps), 150e-6).evict == 0.0


def test_a_negative_evict_weight_is_refused():
    with pytest.raises(ValueError, match="evict"):
        CostWeights(evict=-1.0)
