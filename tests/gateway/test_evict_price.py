"""cache_aware's price of eviction (gateway/routing/policies/cache_aware.py, `evict`): a
request's uncached prompt on a replica whose cache is full pushes out blocks that a later
request may ask for, so a spill there costs that recompute too. The caches' contents come from
a real BlockIndex fed KV events, their sizes from what the workers report. With the latency
laws of the calibrated sim (tests/support/latency_laws.py), a holder with a request there loses
a 3,800-token hit of a 4,000-token prompt to an idle replica with room (the price of
imbalance, tests/gateway/test_load_price.py: the hit saves about 100 ms, the request there
costs about 125) but keeps it against idle replicas whose caches are full (the recompute
would also evict 4,000 tokens, about 110 ms more); `--evict-weight 0` turns the charge off.
On a worker with a host KV tier what the GPU evicts moves there: it costs a later request only
the copy back, until that tier is full too."""

from __future__ import annotations

import pytest

from cachekey.documents import KVEventsEndpoint
from cachekey.events import BlockRemoved, BlockStored
from cachekey.keys import HashNamespace, block_keys
from gateway.config import CostWeights, GatewayConfig
from gateway.fleet.copy_rate import PRIOR_RATIO
from gateway.fleet.ranks import RankSlot
from gateway.fleet.replica import Replica
from gateway.index.block_index import BlockIndex
from gateway.routing.policies import POLICIES, RouteContext
from gateway.routing.policies.cache_aware import explain
from gateway.routing.policies.fleet_cost import (
    dropped_tokens,
    evicted_tokens,
    eviction_seconds,
    fleet_model,
    learned_rate,
)
from tests.support.latency_laws import fleet

NS = HashNamespace("demo", 16)
SIZE = 400  # blocks in each replica's cache


def sized(reps: list[Replica], blocks: int = SIZE, host: int | None = None) -> None:
    """Each replica's cache holds `blocks` blocks (and its host tier `host`), as its
    /kvgate/info says."""
    for r in reps:
        r.slot = RankSlot(None, None, None, KVEventsEndpoint(enabled=False), blocks, None, host)


def fill(
    index: BlockIndex, r: Replica, blocks: int, first_token: int = 100_000, medium: str = "GPU"
) -> None:
    """`r` reports `blocks` blocks of another prompt stored (in its host tier: `medium` CPU)."""
    tokens = list(range(first_token, first_token + 16 * blocks))
    stored = BlockStored(
        block_hashes=list(range(first_token, first_token + blocks)),
        parent_block_hash=None,
        token_ids=tokens,
        block_size=16,
        extra_keys=[None] * blocks,
        medium=medium,
    )
    assert index.apply(r.id, NS, [stored]) == 1


def ctx_for(
    reps: list[Replica], index: BlockIndex, prompt: int, held: int, host_tier: bool = True
) -> RouteContext:
    """A `prompt`-token request of which w0 holds `held` tokens; `host_tier` False: routed as
    `--ignore-host-tier` does."""
    keys = block_keys(list(range(prompt)), NS)
    hits = {reps[0].id: held // 16}
    host = index.lookup.replica_host_blocks if host_tier else None
    return RouteContext(
        reps, keys, prompt, 16, hits, {}, keys[0], None, {}, index.lookup.replica_blocks, host
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


def test_the_host_tier_drops_what_it_has_no_room_for():
    index = BlockIndex()
    (r,) = fleet()[:1]
    sized([r], 100)
    host = index.lookup.replica_host_blocks
    assert dropped_tokens(r, 160, 16, host) is None  # no host tier said: every token lost
    sized([r], 100, host=50)
    assert dropped_tokens(r, 160, 16, None) is None  # its contents unknown
    assert dropped_tokens(r, 160, 16, host) == 0  # 10 blocks into an empty tier of 50
    fill(index, r, 45, first_token=500_000, medium="CPU")
    assert index.lookup.replica_blocks(r.id) == 0  # the host tier's blocks are not the GPU's
    assert dropped_tokens(r, 160, 16, host) == 5 * 16  # 5 free: 5 of its LRU go
    # Priced: moved tokens at the copy, dropped ones at what they now cost more.
    assert eviction_seconds(160, None, 2.0, 0.5) == 320.0
    assert eviction_seconds(160, 0, 2.0, 0.5) == 80.0
    assert eviction_seconds(160, 80, 2.0, 0.5) == 80.0 + 120.0


def test_an_eviction_into_a_host_tier_with_room_costs_only_the_copy_back():
    reps, index = fleet(), BlockIndex()
    sized(reps, host=SIZE)
    policy = POLICIES["cache_aware"](GatewayConfig())
    reps[0].in_flight = 1
    for r in reps[1:]:
        fill(index, r, SIZE)
    ctx = ctx_for(reps, index, 4000, 3800)
    fit, floor = fleet_model(reps), 150e-6
    rate = learned_rate(fit, floor)
    # The idle replicas' GPU caches are full, but what they evict is kept in their host tiers:
    # the load decides, as with room (test_a_busier_holder_keeps_a_hit_...).
    assert policy.rank(ctx)[0] is not reps[0]
    idle = policy.cost(ctx, reps[1], 0.0, 1.0, fit, floor)
    assert idle.evict == pytest.approx(rate * PRIOR_RATIO * 250 * 16)
    # Their host tiers full too: what the GPU evicts pushes as much out of the worker.
    for r in reps[1:]:
        fill(index, r, SIZE, first_token=700_000, medium="CPU")
    assert policy.cost(ctx, reps[1], 0.0, 1.0, fit, floor).evict == pytest.approx(rate * 250 * 16)
    assert policy.rank(ctx)[0] is reps[0]
    # Routing as if no worker had a host tier (--ignore-host-tier) prices every eviction lost.
    for r in reps[1:]:
        gone = BlockRemoved(block_hashes=list(range(700_000, 700_000 + SIZE)), medium="CPU")
        assert index.apply(r.id, NS, [gone]) == 1
    blind = ctx_for(reps, index, 4000, 3800, host_tier=False)
    assert policy.cost(blind, reps[1], 0.0, 1.0, fit, floor).evict == pytest.approx(rate * 250 * 16)
    assert policy.rank(blind)[0] is reps[0]
    assert policy.rank(ctx_for(reps, index, 4000, 3800))[0] is not reps[0]
