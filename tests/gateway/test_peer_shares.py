"""PeerShares (gateway/peers/shares.py): every gateway computes its share of a replica's cap from
the same published demands, so the shares add up to the cap, whatever the demands, the cap and
the number of gateways; a gateway with no peer up has the whole cap."""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import pytest

from gateway.index.block_index import BlockIndex
from gateway.peers.shares import HOLD, PeerShares
from gateway.peers.view import Peer, PeerView

REPLICAS = [f"replica-{i}" for i in range(12)]


def gateways(demands: list[int], cap: int) -> list[PeerShares]:
    """One PeerShares per gateway, each with a view holding every other's published demand."""
    senders = [f"gw-{i:02d}" for i in range(len(demands))]
    out = []
    for me, sender in enumerate(senders):
        view = PeerView(BlockIndex(1000, 2.0), dict, 1.0, lambda: None, 60.0)
        view.sent_demand = demands[me]
        for other, s in enumerate(senders):
            if other != me:
                view.peers[s] = Peer(s, 0.0, demand=demands[other])
        out.append(PeerShares(view, sender, cap, lambda: None, lambda: None))
    return out


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("cap", [1, 2, 3, 4, 7, 16, 256])
def test_shares_add_up_to_the_cap_on_every_replica(n: int, cap: int) -> None:
    rng = random.Random(n * 1000 + cap)
    cases = [[0] * n, [5] * n]
    cases += [[rng.choice([0, 1, 2, 9, 40]) for _ in range(n)] for _ in range(20)]
    for demands in cases:
        splits = [g.split() for g in gateways(demands, cap)]
        for rid in REPLICAS:
            limits = [s.limit(rid) for s in splits if s is not None]
            assert len(limits) == n and min(limits) >= 0
            assert sum(limits) == cap, (demands, rid, limits)


def test_shares_follow_demand_and_spread_spare_slots_over_replicas() -> None:
    busy, idle = (g.split() for g in gateways([30, 0], 16))
    assert busy is not None and idle is not None
    # 31 : 1 of 16 slots (15.5 : 0.5, the spare slot taken in turns): the busy gateway holds
    # nearly all of every replica.
    assert all(busy.limit(r) >= 15 and busy.limit(r) + idle.limit(r) == 16 for r in REPLICAS)
    assert {idle.limit(r) for r in REPLICAS} == {0, 1}
    # Equal demand, a cap smaller than the gateways: each gets some replicas, none all.
    splits = [g.split() for g in gateways([3, 3, 3, 3], 2)]
    held = [sum(s.limit(r) for r in REPLICAS) for s in splits if s is not None]
    assert sum(held) == 2 * len(REPLICAS) and all(0 < h < 2 * len(REPLICAS) for h in held)


def test_alone_the_whole_cap() -> None:
    (alone,) = gateways([7], 4)
    assert alone.split() is None  # no peer up: admission applies the cap alone


def test_a_dropped_peer_gives_its_share_back() -> None:
    a, _b = gateways([2, 2], 4)
    before = a.split()
    assert before is not None and all(before.limit(r) == 2 for r in REPLICAS)
    woke = []
    a.view._freed = lambda: woke.append(1)
    a.view.drop(next(iter(a.view.peers)))
    assert a.split() is None and woke  # the waiters look again, with the whole cap


def test_every_order_of_senders_agrees() -> None:
    """The tie order is by sender id, not by who computes it."""
    for demands in itertools.product([0, 1, 3], repeat=3):
        splits = [g.split() for g in gateways(list(demands), 5)]
        for rid in REPLICAS:
            assert sum(s.limit(rid) for s in splits if s is not None) == 5


def test_a_grown_share_waits_a_shrunk_one_applies_at_once() -> None:
    """A gateway learns of its own demand first: its grown share waits HOLD seconds, for the
    peers to apply their shrunk ones (which they do as the batch arrives), then wakes its
    waiters."""

    async def scenario() -> None:
        a, b = gateways([2, 2], 8)
        woke: list[float] = []
        a._wake = lambda: woke.append(time.monotonic())
        first = a.split()
        assert first is not None and first.limit("r") == 4
        a.view.sent_demand = 14  # a's demand grew: 15 : 3 of 8
        started = time.monotonic()
        held = a.split()
        assert held is not None and held.limit("r") == 4  # not yet
        b.view.peers[a.sender].demand = 14  # b hears it: its share shrinks at once
        shrunk = b.split()
        assert shrunk is not None and shrunk.limit("r") == 1
        await asyncio.sleep(HOLD * 1.5)
        grown = a.split()
        assert grown is not None and grown.limit("r") == 7  # 6.67, and the spare slot
        assert woke and woke[0] - started >= HOLD * 0.9  # its waiters were told

    asyncio.run(scenario())
