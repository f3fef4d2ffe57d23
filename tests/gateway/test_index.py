"""BlockIndex: dual keys, per-copy counts, unknown parents, clears, LRU cap, speculation."""

from __future__ import annotations

import msgspec

from cachekey.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from cachekey.keys import HashNamespace, block_extra_keys, block_keys
from cachekey.types import MMItem
from gateway.index.block_index import BlockIndex
from gateway.names import ReplicaId

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
    assert idx.lookup.match(keys, [A, B]) == {A: 4, B: 0}
    # Without the salt (another tenant) nothing matches: the salt is in block 0's key.
    assert idx.lookup.match(block_keys(tokens, NS, mm), [A]) == {A: 0}
    # A different image at the same placeholder positions gives different keys after block 0.
    other = block_keys(tokens, NS, (MMItem("img-2", "image", 3, 6),), None, "salt")
    assert idx.lookup.match(other, [A]) == {A: 0}


def test_unknown_parent_is_skipped_not_reanchored():
    tokens = list(range(16))
    idx = BlockIndex()
    idx.apply(A, NS, [_stored(tokens, [b"x" * 16], parent=b"unknown-parent!!", start_block=1)])
    assert len(idx) == 0 and idx.skipped_unknown_parent == 1
    assert idx.lookup.match(block_keys(tokens, NS), [A]) == {A: 0}


def test_per_copy_counts_and_removal_through_engine_hash():
    tokens = list(range(8))
    keys = block_keys(tokens, NS)
    idx = BlockIndex()
    ev = _stored(tokens, [1, 2])
    idx.apply(A, NS, [ev, ev])  # two copies of the same blocks (vLLM publishes per copy)
    idx.apply(B, NS, [_stored(tokens, [7, 8])])
    idx.apply(A, NS, [BlockRemoved(block_hashes=[2])])
    assert idx.lookup.match(keys, [A, B]) == {A: 2, B: 2}
    idx.apply(A, NS, [BlockRemoved(block_hashes=[2])])
    assert idx.lookup.match(keys, [A, B]) == {A: 1, B: 2}
    idx.apply(B, NS, [AllBlocksCleared()])
    assert idx.lookup.match(keys, [A, B]) == {A: 1, B: 0}
    assert idx.lookup.replica_blocks(A) == 1 and idx.lookup.replica_blocks(B) == 0
    assert len(idx) == 1


def test_match_is_consecutive_from_block_zero():
    tokens = list(range(12))
    keys = block_keys(tokens, NS)
    idx = BlockIndex()
    idx.apply(A, NS, [_stored(tokens, [1, 2, 3])])
    idx.apply(A, NS, [BlockRemoved(block_hashes=[2])])  # hole in the middle
    assert idx.lookup.match(keys, [A]) == {A: 1}
    idx.apply(A, NS, [BlockRemoved(block_hashes=[1])])
    assert idx.lookup.match(keys, [A]) == {A: 0}  # block 2 alone is no prefix


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
    assert idx.lookup.match(newest, [A]) == {A: 4}
    assert idx.lookup.match(oldest, [A]) == {A: 0}
    assert idx.lookup.replica_blocks(A) == 10


def test_speculative_entries_expire_and_yield_to_real_events():
    tokens = list(range(8))
    keys = block_keys(tokens, NS)
    idx = BlockIndex(speculative_ttl=2.0)
    guess = idx.speculate(B, keys, now=100.0)
    assert idx.lookup.match(keys, [A, B], now=101.0) == {A: 0, B: 2}
    assert idx.lookup.match(keys, [A, B], speculative=False) == {A: 0, B: 0}
    assert idx.lookup.match(keys, [A, B], now=150.0) == {A: 0, B: 2}  # in flight: no expiry
    guess.release(now=150.0)  # the request ended: ttl from here
    assert idx.lookup.match(keys, [A, B], now=151.5) == {A: 0, B: 2}
    assert idx.lookup.match(keys, [A, B], now=152.5) == {A: 0, B: 0}
    idx.speculate(A, keys, now=200.0)
    idx.apply(A, NS, [_stored(tokens, [1, 2])])
    assert idx.lookup.match(keys, [A], now=300.0) == {A: 2}  # real entries do not expire


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
    assert idx.lookup.match(block_keys(tokens, NS), [A]) == {A: 1}


def test_drop_replica_and_digest():
    tokens = list(range(8))
    idx = BlockIndex()
    idx.apply(A, NS, [_stored(tokens, [1, 2])])
    idx.apply(B, NS, [_stored(tokens, [b"k1", b"k2"])])
    assert idx.lookup.replica_digest(A) == idx.lookup.replica_digest(B)
    idx.drop_replica(A)
    assert idx.lookup.replica_digest(A) != idx.lookup.replica_digest(B)
    assert idx.lookup.match(block_keys(tokens, NS), [A, B]) == {A: 0, B: 2}


def _group_store(tokens, hashes, group, *, first=0, kind="full_attention", window=None):
    """A hybrid model's store as vLLM 0.32 sends it: the tokens of blocks `first` on (as many as
    it handed the group), the hashes of only those `hashes` names (block index -> hash)."""
    n = len(tokens) // 4
    return BlockStored(
        block_hashes=list(hashes.values()),
        parent_block_hash=None if first == 0 else 1000 + first - 1,
        token_ids=list(tokens[first * 4 : n * 4]),
        block_size=4,
        extra_keys=[None] * len(hashes),
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def test_sliding_window_group_stores_only_its_kept_blocks():
    """vLLM's sliding-window group names only the blocks a later hit can end on (here 4 and 5,
    the window of 8 tokens before the prompt's last full block) with every block's tokens, and
    comes before the full-attention group's store that keys them in the same batch. The index
    holds 4 and 5 in the sliding slot only, so a prompt that diverges earlier hits nothing."""
    tokens = list(range(100, 126))  # 6 full blocks
    full = {i: 1000 + i for i in range(6)}
    swa = _group_store(tokens, {4: 1004, 5: 1005}, 0, kind="sliding_window", window=8)
    batch = msgspec.msgpack.encode([0.0, [swa, _group_store(tokens, full, 1)], 0])
    decoded = decode_batch(batch)
    assert decoded.errors == []  # more tokens than hashes is a sparse group, not malformed
    idx = BlockIndex()
    assert idx.apply(A, NS, decoded.events) == 2
    assert idx.skipped_unknown_parent == 0 and not idx.errors

    def hit(prompt):
        return idx.lookup.match(block_keys(prompt, NS), [A], tokens=prompt)[A]

    assert hit([*tokens[:24], 7]) == 6  # the whole prefix: the window's blocks are there
    assert hit([*tokens[:16], 7]) == 0  # diverges after block 3: nothing kept before it
    # A later step's sliding-window store of decode-filled blocks keeps none of them.
    decode = _group_store(tokens, {}, 0, first=5, kind="sliding_window", window=8)
    assert idx.apply(A, NS, [decode]) == 1 and not idx.errors
    # Blocks 2 and 3 kept later (a shared-prefix junction): the early prompt hits them.
    junction = _group_store(tokens[:16], {2: 1002, 3: 1003}, 0, kind="sliding_window", window=8)
    idx.apply(A, NS, [junction])
    assert hit([*tokens[:16], 7]) == 4


def test_a_sparse_store_never_guesses_a_block_it_cannot_key():
    """A sliding-window hash no store of the replica has keyed (events lost before a replay
    buffer's start) is skipped and counted; the ones it can key are held."""
    tokens = list(range(100, 116))
    idx = BlockIndex()
    idx.apply(A, NS, [_group_store(tokens[:8], {0: 1000, 1: 1001}, 1)])
    swa = _group_store(tokens, {1: 1001, 3: 1003}, 0, kind="sliding_window", window=8)
    assert idx.apply(A, NS, [swa]) == 1
    assert idx.skipped_unknown_parent == 1
    keys = block_keys(tokens, NS)
    assert idx.lookup.holds(A, keys[1]) and not idx.lookup.holds(A, keys[3])


def test_a_sparse_store_with_too_few_tokens_is_malformed():
    ev = ["BlockStored", [1, 2], None, list(range(4)), 4]  # 2 hashes, 1 block of tokens
    ragged = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None}
    ragged |= {"token_ids": list(range(6)), "block_size": 4}  # not whole blocks
    assert decode_batch(msgspec.msgpack.encode([0.0, [ev, ragged], 0])).errors == [
        "length_mismatch",
        "length_mismatch",
    ]


def test_a_mamba_group_hits_where_it_kept_the_state():
    """vLLM's Mamba manager hits up to the last block whose end state it kept (its
    find_longest_cache_hit: the rightmost cached block within the full-attention prefix)."""
    tokens = list(range(100, 124))  # 6 full blocks
    idx = BlockIndex()
    mamba = _group_store(tokens, {1: 1001, 5: 1005}, 0, kind="mamba")
    idx.apply(A, NS, [mamba, _group_store(tokens, {i: 1000 + i for i in range(6)}, 1)])

    def hit(prompt):
        return idx.lookup.match(block_keys(prompt, NS), [A], tokens=prompt)[A]

    assert hit([*tokens, 7]) == 6
    assert hit([*tokens[:16], 7]) == 2  # the state after block 1, not 3
    assert hit([*tokens[:4], 7]) == 0
