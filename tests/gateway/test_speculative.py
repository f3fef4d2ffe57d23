"""Speculative entries: a routed request's keys count for its replica when the worker would
really hit them, live while the request is in flight, and never outgrow the replica's cache."""

from __future__ import annotations

from cachekey.events import BlockStored
from cachekey.keys import HashNamespace, block_keys
from gateway.index.block_index import BlockIndex
from gateway.names import ReplicaId

NS = HashNamespace("demo", block_size=4)
A, B = ReplicaId("http://a"), ReplicaId("http://b")


def _keys(seed: int, blocks: int) -> list[bytes]:
    return block_keys([seed * 1000 + t for t in range(4 * blocks)], NS)


def test_a_deferring_worker_counts_a_guess_at_once_another_after_its_prefill():
    idx = BlockIndex()
    idx.set_traits(A, defers=True, num_blocks=None)
    idx.set_traits(B, defers=False, num_blocks=None)
    keys = _keys(1, 3)
    on_a = idx.speculate(A, keys, now=0.0)
    on_b = idx.speculate(B, keys, now=0.0)
    # B's worker would compute a sibling's shared prefix again: no hit until its prefill ends.
    assert idx.lookup.match(keys, [A, B], now=0.0) == {A: 3, B: 0}
    on_b.show(now=0.1)  # its first token: the prefill finished
    assert idx.lookup.match(keys, [A, B], now=0.1) == {A: 3, B: 3}
    on_a.release(now=0.2)
    on_b.release(now=0.2)
    assert idx.lookup.match(keys, [A, B], now=2.1) == {A: 3, B: 3}
    assert idx.lookup.match(keys, [A, B], now=2.3) == {A: 0, B: 0}  # ttl after the end
    assert idx.lookup.speculated() == frozenset()


def test_a_request_still_prefilling_is_not_shown_until_it_ends():
    idx = BlockIndex()
    idx.set_traits(B, defers=False, num_blocks=None)
    keys = _keys(2, 2)
    guess = idx.speculate(B, keys, now=0.0)
    assert idx.lookup.match(keys, [B], now=50.0) == {B: 0}
    guess.release(now=50.0)  # a non-streamed answer: its end is the first sign
    assert idx.lookup.match(keys, [B], now=51.0) == {B: 2}


def test_shared_keys_live_while_any_request_using_them_is_in_flight():
    idx = BlockIndex(speculative_ttl=1.0)
    shared = _keys(3, 2)
    first = idx.speculate(A, shared, now=0.0)
    second = idx.speculate(A, shared, now=0.5)
    first.release(now=1.0)
    assert idx.lookup.match(shared, [A], now=30.0) == {A: 2}  # the second is still in flight
    second.release(now=30.0)
    assert idx.lookup.match(shared, [A], now=30.5) == {A: 2}
    assert idx.lookup.match(shared, [A], now=31.5) == {A: 0}


def test_a_request_that_moved_on_takes_its_guess_with_it():
    idx = BlockIndex()
    keys = _keys(4, 2)
    other = idx.speculate(A, keys[:1], now=0.0)  # another request shows block 0
    moved = idx.speculate(A, keys, now=0.0)
    moved.discard()  # connect error: it never reached A
    assert idx.lookup.match(keys, [A], now=0.0) == {A: 1}
    other.discard()
    assert idx.lookup.match(keys, [A], now=0.0) == {A: 0}
    assert idx.lookup.speculated() == frozenset()


def test_guesses_are_capped_at_the_cache_size_oldest_idle_first():
    idx = BlockIndex(speculative_ttl=3600.0)
    idx.set_traits(A, defers=True, num_blocks=4)
    old, busy, new = _keys(5, 2), _keys(6, 2), _keys(7, 2)
    idx.speculate(A, old, now=0.0).release(now=0.0)
    in_flight = idx.speculate(A, busy, now=1.0)
    idx.speculate(A, new, now=2.0)
    # Six keys for four blocks: the two oldest idle ones go; in-flight keys stay.
    assert idx.lookup.match(old, [A], now=3.0) == {A: 0}
    assert idx.lookup.match(busy, [A], now=3.0) == {A: 2}
    assert idx.lookup.match(new, [A], now=3.0) == {A: 2}
    in_flight.release(now=3.0)
    assert idx.lookup.match(busy, [A], now=4.0) == {A: 2}


def test_real_events_replace_guesses_and_a_dropped_replica_forgets_them():
    idx = BlockIndex()
    tokens = list(range(8))
    keys = block_keys(tokens, NS)
    guess = idx.speculate(A, keys, now=0.0)
    stored = BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=tokens, block_size=4)
    idx.apply(A, NS, [stored])
    assert idx.lookup.speculated() == frozenset() and idx.lookup.match(
        keys, [A], speculative=False
    ) == {A: 2}
    guess.release(now=1.0)  # nothing left to release: a no-op
    stale = idx.speculate(B, _keys(8, 2), now=0.0)
    idx.drop_replica(B)
    idx.speculate(ReplicaId("http://c"), _keys(9, 1), now=0.0)  # may reuse B's slot
    stale.release(now=1.0)  # a guess that outlived its replica changes nothing
    assert idx.lookup.match(_keys(9, 1), [ReplicaId("http://c")], now=1.0) == {
        ReplicaId("http://c"): 1
    }
    assert idx.lookup.match(_keys(8, 2), [B], now=1.0) == {B: 0}
