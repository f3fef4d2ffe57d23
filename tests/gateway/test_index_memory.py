"""The gateway's memory stays bounded under churn: found by the soak run (docs/reliability.md).

Every routed request adds speculative entries for its block keys; when the worker's real
BlockStored event arrives it replaces the guess. The replaced guess used to leave an empty map
behind under the key, one per distinct block ever routed, so the gateway grew without bound.
"""

from __future__ import annotations

from cachekey.events import BlockStored
from cachekey.keys import HashNamespace, block_keys
from gateway.index.block_index import BlockIndex
from gateway.names import ReplicaId

NS = HashNamespace("demo", block_size=4)
A, B = ReplicaId("http://a"), ReplicaId("http://b")


def _stored(tokens: list[int], keys: list[bytes]) -> BlockStored:
    return BlockStored(
        block_hashes=keys,
        parent_block_hash=None,
        token_ids=tokens,
        block_size=NS.block_size,
    )


def test_confirmed_speculative_entries_are_freed() -> None:
    index = BlockIndex(speculative_ttl=3600.0)  # nothing expires during the test
    for i in range(200):
        tokens = [i, i + 1, i + 2, i + 3, 7, 7, 7, 7]
        keys = block_keys(tokens, NS)
        index.speculate(A, keys, now=0.0)
        assert index.lookup.match(keys, [A], now=0.0) == {A: 2}
        index.apply(A, NS, [_stored(tokens, keys)])
        assert index.lookup.match(keys, [A], speculative=False) == {A: 2}
    # The real events replaced every guess: no speculative state is left behind.
    assert index.lookup.speculated() == frozenset()
    assert len(index) == 400


def test_drop_replica_frees_its_speculative_entries() -> None:
    index = BlockIndex(speculative_ttl=3600.0)
    only_a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], NS)
    shared = block_keys([9, 9, 9, 9], NS)
    index.speculate(A, [*only_a, *shared], now=0.0)
    index.speculate(B, shared, now=0.0)
    index.drop_replica(A)
    assert index.lookup.match(only_a, [A, B], now=0.0) == {A: 0, B: 0}
    assert index.lookup.match(shared, [A, B], now=0.0) == {A: 0, B: 1}
    assert index.lookup.speculated() == set(shared)
