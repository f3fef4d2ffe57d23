"""BlockIndex: dual keys, per-copy counts, unknown parents, clears, LRU cap, speculation."""

from __future__ import annotations

import msgspec

from cachekey.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from cachekey.keys import HashNamespace, block_extra_keys, block_keys
from cachekey.types import MMItem
from gateway.index import BlockIndex, ReplicaId

NS = HashNamespace("demo", block_size=4)
A, B = ReplicaId("http://a"), ReplicaId("http://b")


def _stored(tokens, engine_hashes, parent=None, mm_items=(), start_block=0, salt=None):
    n = len(engine_hashes)
    extra = [
        block_extra_keys(start_block + i, NS.block_size, mm_items, None, salt) or None
        for i in range(n)
    ]
    return BlockStored(
        block_hashes=list(engine_hashes),
        parent_block_hash=parent,
        token_ids=list(tokens[start_block * 4 : (start_block + n) * 4]),
        block_size=4,
        extra_keys=extra,
    )


def test_dual_keys_equal_request_keys_for_any_engine_hash():
    tokens = list(range(100, 118))  # 4 full blocks + 2 tail tokens
    mm = (MMItem("img-1", "image", 3, 6),)
    keys = block_keys(tokens, NS, mm, None, "salt")
    idx = BlockIndex()
    # Engine hashes are opaque: ints (vLLM's default wire form) chained via the parent field.
    idx.apply(A, NS, [_stored(tokens, [11, 12], None, mm, 0, "salt")])
    idx.apply(A, NS, [_stored(tokens, [13, 14], 12, mm, 2, "salt")])
    assert idx.match(keys, [A, B]) == {A: 4, B: 0}
    # Without the salt (another tenant) nothing matches: the salt is in block 0's key.
    assert idx.match(block_keys(tokens, NS, mm), [A]) == {A: 0}
    # A different image at the same placeholder positions gives different keys after block 0.
    other = block_keys(tokens, NS, (MMItem("img-2", "image", 3, 6),), None, "salt")
    assert idx.match(other, [A]) == {A: 0}


def test_unknown_parent_is_skipped_not_reanchored():
    tokens = list(range(16))
    idx = BlockIndex()
    idx.apply(A, NS, [_stored(tokens, [b"x" * 16], parent=b"unknown-parent!!", start_block=1)])
    assert len(idx) == 0 and idx.skipped_unknown_parent == 1
    assert idx.match(block_keys(tokens, NS), [A]) == {A: 0}


def test_per_copy_counts_and_removal_through_engine_hash():
    tokens = list(range(8))
    keys = block_keys(tokens, NS)
    idx = BlockIndex()
    ev = _stored(tokens, [1, 2])
    idx.apply(A, NS, [ev, ev])  # two copies of the same blocks (vLLM publishes per copy)
    idx.apply(B, NS, [_stored(tokens, [7, 8])])
    idx.apply(A, NS, [BlockRemoved(block_hashes=[2])])
    assert idx.match(keys, [A, B]) == {A: 2, B: 2}
    idx.apply(A, NS, [BlockRemoved(block_hashes=[2])])
    assert idx.match(keys, [A, B]) == {A: 1, B: 2}
    idx.apply(B, NS, [AllBlocksCleared()])
    assert idx.match(keys, [A, B]) == {A: 1, B: 0}
    assert idx.replica_blocks(A) == 1 and idx.replica_blocks(B) == 0
    assert len(idx) == 1


def test_match_is_consecutive_from_block_zero():
    tokens = list(range(12))
    keys = block_keys(tokens, NS)
    idx = BlockIndex()
    idx.apply(A, NS, [_stored(tokens, [1, 2, 3])])
    idx.apply(A, NS, [BlockRemoved(block_hashes=[2])])  # hole in the middle
    assert idx.match(keys, [A]) == {A: 1}
    idx.apply(A, NS, [BlockRemoved(block_hashes=[1])])
    assert idx.match(keys, [A]) == {A: 0}  # block 2 alone is no prefix


def test_lru_cap_bounds_memory():
    idx = BlockIndex(max_blocks=10)
    for g in range(5):
        tokens = [g * 1000 + t for t in range(16)]
        idx.apply(A, NS, [_stored(tokens, [g * 10 + i for i in range(4)])])
    assert len(idx) == 10
    s = idx.stats()
    assert s.blocks == 10 and s.copies == 10 and s.bytes > 0
    newest = block_keys([4000 + t for t in range(16)], NS)
    oldest = block_keys(list(range(16)), NS)
    assert idx.match(newest, [A]) == {A: 4}
    assert idx.match(oldest, [A]) == {A: 0}
    assert idx.replica_blocks(A) == 10


def test_speculative_entries_expire_and_yield_to_real_events():
    tokens = list(range(8))
    keys = block_keys(tokens, NS)
    idx = BlockIndex(speculative_ttl=2.0)
    guess = idx.add_speculative(B, keys, now=100.0)
    assert idx.match(keys, [A, B], now=101.0) == {A: 0, B: 2}
    assert idx.match(keys, [A, B], speculative=False) == {A: 0, B: 0}
    assert idx.match(keys, [A, B], now=150.0) == {A: 0, B: 2}  # in flight: no expiry
    idx.spec.release(guess, now=150.0)  # the request ended: ttl from here
    assert idx.match(keys, [A, B], now=151.5) == {A: 0, B: 2}
    assert idx.match(keys, [A, B], now=152.5) == {A: 0, B: 0}
    idx.add_speculative(A, keys, now=200.0)
    idx.apply(A, NS, [_stored(tokens, [1, 2])])
    assert idx.match(keys, [A], now=300.0) == {A: 2}  # real entries do not expire


def test_vllm_positional_encoding_with_int_hashes():
    tokens = list(range(8))
    raw = [
        1.5,
        [
            ["BlockStored", [111, 222], None, tokens, 4, None, "GPU", None, None],
            ["BlockRemoved", [222], "GPU"],
            ["SomeFutureEvent", 1, 2],
        ],
        0,
    ]
    batch = decode_batch(msgspec.msgpack.encode(raw))
    idx = BlockIndex()
    idx.apply(A, NS, batch.events)
    assert idx.match(block_keys(tokens, NS), [A]) == {A: 1}


def test_drop_replica_and_digest():
    tokens = list(range(8))
    idx = BlockIndex()
    idx.apply(A, NS, [_stored(tokens, [1, 2])])
    idx.apply(B, NS, [_stored(tokens, [b"k1", b"k2"])])
    assert idx.replica_digest(A) == idx.replica_digest(B)
    idx.drop_replica(A)
    assert idx.replica_digest(A) != idx.replica_digest(B)
    assert idx.match(block_keys(tokens, NS), [A, B]) == {A: 0, B: 2}
