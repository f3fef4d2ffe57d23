"""PeerView: a peer's batches applied to a real index and real replicas (the rules of gap, expiry
and restart that the two-process test in tests/gateway/test_peers.py cannot time exactly)."""

from __future__ import annotations

import time

from cachekey.keys import HashNamespace, block_keys
from gateway.fleet.replica import Replica
from gateway.index.block_index import BlockIndex
from gateway.names import ReplicaId
from gateway.peers.view import PeerView
from gateway.peers.wire import PLACED, RELEASED, PeerBatch, Placement, decode, encode

NS = HashNamespace("demo", block_size=4)
A = ReplicaId("http://a")
TTL = 0.5


def _setup():
    idx = BlockIndex(speculative_ttl=TTL)
    rep = Replica(A, "http://a", healthy=True)
    woken = []
    view = PeerView(idx, lambda: {A: rep}, 1.0, lambda: woken.append(1), 60.0)
    return idx, rep, view, woken


def _batch(seq: int, load: dict, *placements: Placement, sender: str = "p1") -> PeerBatch:
    # Through the wire, as a receiver gets it.
    return decode(encode(PeerBatch(sender, seq, time.time(), load, list(placements))))


def test_load_and_placements_apply_and_a_peer_release_ends_the_entry() -> None:
    idx, rep, view, woken = _setup()
    keys = block_keys(list(range(12)), NS)
    view.apply(_batch(1, {A: 2}, Placement(PLACED, 7, A, keys, 12)), now=0.0)
    assert (rep.in_flight, rep.peer_in_flight) == (2, 2)
    assert idx.lookup.hits(keys) == {A: 3}  # a kvgate worker defers: shown at once
    assert rep.recent_prefill == 12
    assert view.own_load() == {}  # none of it is this gateway's own
    view.apply(_batch(2, {}, Placement(RELEASED, 7)), now=0.1)
    assert (rep.in_flight, rep.peer_in_flight, woken) == (0, 0, [1])
    assert idx.lookup.hits(keys, now=time.monotonic() + TTL + 0.1) == {}
    assert (view.received, view.applied) == (2, 2)


def test_a_gap_releases_the_peers_entries_and_a_silent_peer_is_dropped() -> None:
    idx, rep, view, _ = _setup()
    keys = block_keys(list(range(100, 108)), NS)
    rep.in_flight = 1  # one of this gateway's own
    view.apply(_batch(1, {A: 3}, Placement(PLACED, 1, A, keys, 8)), now=0.0)
    assert rep.in_flight == 4 and view.own_load() == {A: 1}
    view.apply(_batch(3, {A: 3}), now=0.5)  # batch 2 was lost: its end may have been in it
    assert view.gaps == 1 and not view.peers["p1"].guesses
    assert idx.lookup.hits(keys, now=time.monotonic() + TTL + 0.1) == {}
    assert view.expire(now=1.0) == 1  # heard from 0.5 s ago: still up
    assert view.expire(now=1.6) == 0  # silent past the timeout: its load goes
    assert (rep.in_flight, rep.peer_in_flight) == (1, 0)
    view.apply(_batch(1, {A: 1}, sender="p2"), now=2.0)  # a restarted peer: a new sender
    assert rep.in_flight == 2 and set(view.peers) == {"p2"}
