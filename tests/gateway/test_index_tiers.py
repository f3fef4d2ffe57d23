"""BlockIndex with a host-memory tier: `medium: "CPU"` events kept per replica beside the GPU's,
removed per medium, and the lookup's hit through both tiers (GPU first)."""

from __future__ import annotations

import msgspec

from cachekey.events import MEDIUM_CPU, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from cachekey.keys import HashNamespace, block_keys
from gateway.index.block_index import BlockIndex
from gateway.names import ReplicaId

NS = HashNamespace("demo", block_size=4)
A, B = ReplicaId("http://a"), ReplicaId("http://b")
TOKENS = list(range(100, 124))  # 6 blocks
KEYS = block_keys(TOKENS, NS)


def _stored(hashes, start, medium="GPU", parent=None):
    n = len(hashes)
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=TOKENS[start * 4 : (start + n) * 4],
        block_size=4,
        medium=medium,
    )


def _tiers(idx, replicas=(A, B)):
    gpu = {}
    total = idx.lookup.hits(KEYS, gpu=gpu)
    return {r: (gpu.get(r, total.get(r, 0)), total.get(r, 0)) for r in replicas}


def test_a_block_in_both_tiers_and_removal_per_medium():
    idx = BlockIndex()
    idx.apply(A, NS, [_stored([1, 2, 3], 0), _stored([1, 2, 3], 0, MEDIUM_CPU)])
    assert _tiers(idx) == {A: (3, 3), B: (0, 0)}
    assert len(idx) == 3 and idx.stats().copies == 6  # one key each, two slots
    idx.apply(A, NS, [BlockRemoved(block_hashes=[2, 3], medium="GPU")])
    assert _tiers(idx) == {A: (1, 3), B: (0, 0)}  # the host tier still holds blocks 1-2
    assert idx.lookup.match(KEYS, [A]) == {A: 1}  # without `gpu`: the GPU's hit alone
    assert idx.lookup.replica_blocks(A) == 1 and idx.lookup.replica_blocks(A, host=True) == 3
    idx.apply(A, NS, [BlockRemoved(block_hashes=[3], medium=MEDIUM_CPU)])
    assert _tiers(idx) == {A: (1, 2), B: (0, 0)}
    idx.apply(A, NS, [BlockRemoved(block_hashes=[1, 2], medium=MEDIUM_CPU)])
    assert _tiers(idx) == {A: (1, 1), B: (0, 0)}
    assert idx.stats().copies == 1 and len(idx) == 1 and idx.other_tier_events == 0


def test_a_prefix_only_in_the_host_tier_is_found_from_block_zero():
    idx = BlockIndex()
    idx.apply(B, NS, [_stored([7, 8, 9, 10], 0, MEDIUM_CPU)])
    assert _tiers(idx) == {A: (0, 0), B: (0, 4)}
    assert idx.lookup.hits(KEYS) == {}  # --ignore-host-tier: no hit at all
    assert not idx.lookup.holds(B, KEYS[0])  # the GPU does not hold it


def test_the_hit_continues_block_by_block_in_either_tier_for_kvgate_workers():
    # GPU: blocks 0-1 and 3; host: block 2. kvgate's worker looks each block up on the GPU,
    # then in its host tier: the hit is 0-3.
    idx = BlockIndex()
    idx.apply(A, NS, [_stored([1, 2, 3, 4], 0), BlockRemoved(block_hashes=[3])])
    idx.apply(A, NS, [_stored([3], 2, MEDIUM_CPU, parent=2)])
    assert _tiers(idx, [A]) == {A: (2, 4)}
    # vLLM's offloading connector looks up only its host tier past the GPU's hit: 0-2. (It
    # stores a block in its host tier once computed, before the GPU evicts it.)
    idx = BlockIndex()
    idx.set_reannouncing(B)
    idx.apply(B, NS, [_stored([1, 2, 3, 4], 0), _stored([3], 2, MEDIUM_CPU, parent=2)])
    idx.apply(B, NS, [BlockRemoved(block_hashes=[3])])
    assert _tiers(idx, [B]) == {B: (2, 3)}


def test_host_stores_are_reference_counted_and_cleared_with_the_replica():
    # vLLM re-announces a block a second chunk overlaps, and removes it as often.
    idx = BlockIndex()
    idx.set_reannouncing(A)
    ev = _stored([1, 2], 0, MEDIUM_CPU)
    idx.apply(A, NS, [_stored([1, 2], 0), ev, ev, BlockRemoved(block_hashes=[1, 2])])
    idx.apply(A, NS, [BlockRemoved(block_hashes=[1, 2], medium=MEDIUM_CPU)])
    assert _tiers(idx, [A]) == {A: (0, 2)}
    idx.apply(A, NS, [AllBlocksCleared()])
    assert _tiers(idx, [A]) == {A: (0, 0)} and len(idx) == 0 and idx.stats().copies == 0


def test_storage_tiers_and_other_groups_host_copies_are_counted_not_applied():
    idx = BlockIndex()
    storage = _stored([1], 0, "STORAGE")
    group1 = msgspec.structs.replace(_stored([1], 0, MEDIUM_CPU), group_idx=1)
    idx.apply(A, NS, [storage, group1, BlockRemoved(block_hashes=[1], medium="STORAGE")])
    assert len(idx) == 0 and idx.other_tier_events == 3


def test_vllm_wire_form_of_a_cpu_store():
    # As vLLM 0.33 sends a self-describing offloading event (tagged map, medium "CPU").
    ev = {"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": None}
    ev |= {"token_ids": TOKENS[:8], "block_size": 4, "medium": "CPU", "lora_name": None}
    ev |= {"extra_keys": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    batch = decode_batch(msgspec.msgpack.encode([1.0, [ev], None]))
    assert not batch.errors
    idx = BlockIndex()
    idx.apply(A, NS, batch.events)
    assert _tiers(idx, [A]) == {A: (0, 2)}


def test_vllm_host_stores_take_the_gpu_blocks_keys_by_engine_hash():
    """vLLM 0.32's host-tier events carry no extra keys ("deferred"): their keys come from the
    GPU's store of the same engine hashes, so a salted (or image) block keeps its identity;
    a hash the GPU never named is skipped, never keyed without its extras."""
    salted = block_keys(TOKENS, NS, (), None, "tenant-1")
    idx = BlockIndex()
    idx.set_reannouncing(A)
    gpu = _stored([1, 2], 0)
    gpu.extra_keys = [("tenant-1",), None]
    idx.apply(A, NS, [gpu, _stored([1, 2], 0, MEDIUM_CPU), BlockRemoved(block_hashes=[1, 2])])
    assert idx.lookup.hits(salted[:2], gpu={}) == {A: 2}  # the salted keys, from the host tier
    assert idx.lookup.hits(KEYS, gpu={}) == {}  # no false hit for the unsalted prompt
    idx.apply(A, NS, [_stored([9], 3, MEDIUM_CPU, parent=8)])
    assert idx.skipped_unknown_parent == 1 and len(idx) == 2
