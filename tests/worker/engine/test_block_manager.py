"""BlockManager unit tests: equality guard, LRU eviction, ref counts, image-match rules, abort."""

from __future__ import annotations

import pytest

from cachekey import BlockKey, HashNamespace, MMItem, MMMatchRule, Prompt
from cachekey.events import BlockRemoved, BlockStored
from gateway.index.block_index import BlockIndex
from gateway.names import ReplicaId
from worker.engine.block_manager import BlockManager
from worker.engine.free_queue import Block, FreeBlockQueue
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, SequenceStatus

BS = 4
NS = HashNamespace("unit-model", block_size=BS)


def seq_of(rid: str, ids: list[int], mm: tuple[MMItem, ...] = (), **kw: str) -> Sequence:
    return Sequence(rid, Prompt(tuple(ids), mm), SamplingParams(), NS, **kw)


def prefill(bm: BlockManager, seq: Sequence) -> int:
    """Admit seq with its cache hit, 'compute' the rest, cache its full blocks; the hit tokens."""
    hits = bm.find_cached_prefix(seq)
    assert bm.can_allocate(seq, hits, seq.num_tokens - len(hits) * BS)
    bm.allocate(seq, hits, seq.num_tokens - len(hits) * BS)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return len(hits) * BS


def test_free_queue_is_fifo_with_o1_removal() -> None:
    blocks = [Block(block_id=i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3]
    q.append(blocks[2])
    assert q.popleft() is blocks[0]
    assert [b.block_id for b in q] == [1, 3, 2]
    assert len(q) == 3 and blocks[0] not in list(q)


def test_hit_requires_same_tokens_and_extra_keys() -> None:
    bm = BlockManager(16, BS, True, "partial")
    a = seq_of("a", list(range(1, 14)))
    assert prefill(bm, a) == 0
    assert prefill(bm, seq_of("same", list(range(1, 14)))) == 12
    # Forged collision: identical keys, different token ids -> not a hit.
    forged = seq_of("forged", [99, *list(range(2, 14))])
    forged.block_keys = list(a.block_keys)
    assert bm.find_cached_prefix(forged) == []
    # Same keys and tokens but different extra keys (say, another image) -> not a hit.
    other = seq_of("other", list(range(1, 14)))
    other.block_extra = [(("img-b", 0),), *other.block_extra[1:]]
    assert bm.find_cached_prefix(other) == []
    # A forged second block stops the match after the first.
    partial = seq_of("partial", [1, 2, 3, 4, 0, 0, 0, 0, 9, 10, 11, 12, 13])
    partial.block_keys = list(a.block_keys)
    assert len(bm.find_cached_prefix(partial)) == 1


def test_lora_and_salt_separate_caches() -> None:
    bm = BlockManager(32, BS, True, "partial")
    ids = list(range(1, 14))
    prefill(bm, seq_of("a", ids))
    assert prefill(bm, seq_of("lora", ids, lora_name="adapter")) == 0
    assert prefill(bm, seq_of("salt", ids, cache_salt="tenant")) == 0
    assert prefill(bm, seq_of("salt2", ids, cache_salt="tenant")) == 12


@pytest.mark.parametrize(("rule", "inside_hit"), [("partial", 8), ("clamp", 0)])
def test_match_inside_image_follows_the_rule_and_leaves_one_token(
    rule: MMMatchRule, inside_hit: int
) -> None:
    bm = BlockManager(32, BS, True, rule)
    img = MMItem("img", "image", offset=2, length=8)  # spans blocks 0..2
    ids = [1, 2] + [7] * 8 + [3, 4, 5, 6, 8, 9]
    first = seq_of("a", ids, (img,))
    prefill(bm, first)
    # Same image, same text: everything up to the last block boundary before the end.
    assert prefill(bm, seq_of("b", ids, (img,))) == 12
    # Only the first two blocks (inside the image) cached: "partial" reuses both, "clamp"
    # rewinds to the block holding the image's start.
    bm2 = BlockManager(32, BS, True, rule)
    short = seq_of("s", ids, (img,))
    hits = bm2.find_cached_prefix(short)
    bm2.allocate(short, hits, 8)
    short.num_computed_tokens = 8
    bm2.cache_full_blocks(short)
    assert len(bm2.pool.cached) == 2
    assert len(bm2.find_cached_prefix(seq_of("t", ids, (img,)))) * BS == inside_hit
    # Another image on the same placeholder tokens shares nothing from its first block on
    # (ATOM #1358), whatever the rule.
    other = MMItem("img-other", "image", offset=2, length=8)
    assert bm.find_cached_prefix(seq_of("o", ids, (other,))) == []
    # An exact repeat of a block-aligned prompt still computes its last token, also when the
    # last token is an image's.
    exact = list(range(1, 9))
    prefill(bm, seq_of("e", exact))
    assert prefill(bm, seq_of("e2", exact)) == 4
    tail = MMItem("tail", "image", offset=3, length=5)  # the image ends the prompt
    prefill(bm, seq_of("i", [1, 2, 3, *[7] * 5], (tail,)))
    assert prefill(bm, seq_of("i2", [1, 2, 3, *[7] * 5], (tail,))) == (
        4 if rule == "partial" else 0
    )


def test_ref_counts_with_shared_prefix() -> None:
    bm = BlockManager(16, BS, True, "partial")
    a, b = seq_of("a", list(range(1, 11))), seq_of("b", [*list(range(1, 9)), 50, 51, 52])
    prefill(bm, a)
    assert prefill(bm, b) == 8
    shared = [bm.pool.blocks[i] for i in a.block_table[:2]]
    assert b.block_table[:2] == a.block_table[:2]
    assert [blk.ref_count for blk in shared] == [2, 2]
    bm.free(a)
    assert [blk.ref_count for blk in shared] == [1, 1]
    assert not set(map(id, shared)) & set(map(id, bm.pool.free_queue))
    bm.free(b)
    assert set(map(id, shared)) <= set(map(id, bm.pool.free_queue))
    assert bm.pool.num_free == 16 and len(bm.pool.cached) == 2  # cached, evictable


def _cache_a_then_b(bm: BlockManager) -> tuple[list[BlockKey], list[BlockKey]]:
    """Cache two 9-token sequences, a then b, and free them: a's blocks are the older ones."""
    a, b = seq_of("a", list(range(1, 10))), seq_of("b", list(range(100, 109)))
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)
    bm.free(b)
    return list(a.block_keys), list(b.block_keys)


def _removed(bm: BlockManager) -> list:
    """The keys BlockRemoved events reported since the last drain."""
    return [h for ev in bm.drain_events() if isinstance(ev, BlockRemoved) for h in ev.block_hashes]


def test_lru_evicts_oldest_and_tail_first() -> None:
    bm = BlockManager(6, BS, True, "partial")
    a_keys, b_keys = _cache_a_then_b(bm)
    bm.drain_events()
    c = seq_of("c", list(range(200, 209)))  # needs 3 blocks: a's tail first, then a's head
    prefill(bm, c)
    assert _removed(bm) == [a_keys[1], a_keys[0]]
    assert set(bm.pool.cached) == set(b_keys) | set(c.block_keys)
    # A hit on b pulls its blocks out of the LRU, so the next eviction takes c's.
    assert prefill(bm, seq_of("b2", list(range(100, 109)))) == 8


def test_refresh_chain_keeps_a_named_prefix_cached_through_the_next_evictions() -> None:
    # The x-kvgate-prefix hint: a's chain, older than b's, is named before c allocates.
    bm = BlockManager(6, BS, True, "partial")
    a_keys, b_keys = _cache_a_then_b(bm)
    assert bm.refresh_chain(a_keys[-1]) == 2
    bm.drain_events()
    # c takes 3 blocks: the two partial ones and b's tail, where without the refresh it
    # takes a's blocks (test_lru_evicts_oldest_and_tail_first).
    prefill(bm, seq_of("c", list(range(200, 209))))
    assert _removed(bm) == [b_keys[1]]
    assert prefill(bm, seq_of("a2", list(range(1, 10)))) == 8


def test_refresh_chain_ignores_unknown_keys_and_broken_chains() -> None:
    bm = BlockManager(5, BS, True, "partial")
    a = seq_of("a", list(range(1, 13)))  # 3 full blocks
    prefill(bm, a)
    keys = list(a.block_keys)
    a0, a1, a2 = (bm.pool.blocks[i] for i in a.block_table)
    bm.free(a)
    assert bm.refresh_chain(BlockKey(b"\x00" * 16)) == 0
    # Blocks 1 and 2 newest, then evict up to block 0: a chain with its head gone.
    bm.pool.refresh([a1, a2])
    bm.pool.take(3)
    assert a0.key is None and a1.key == keys[1] and a2.key == keys[2]
    order = [blk.block_id for blk in bm.pool.free_queue]
    assert bm.refresh_chain(keys[2]) == 0
    assert [blk.block_id for blk in bm.pool.free_queue] == order  # nothing moved


def test_events_describe_stored_blocks() -> None:
    bm = BlockManager(16, BS, True, "partial")
    img = MMItem("pic", "image", offset=3, length=2)
    s = seq_of("a", [1, 2, 3, 9, 9, 6, 7, 8, 10], (img,), lora_name="lo")
    prefill(bm, s)
    (ev,) = bm.drain_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == s.block_keys and ev.parent_block_hash is None
    assert ev.token_ids == [1, 2, 3, 9, 9, 6, 7, 8] and ev.block_size == BS
    assert ev.lora_name == "lo"
    assert ev.extra_keys == [("lo", ("pic", 3)), ("lo", ("pic", -1))]
    snap = bm.snapshot()
    assert [b.key for b in snap] == s.block_keys
    assert snap[1].parent == s.block_keys[0]


def test_no_prefix_caching_caches_and_publishes_nothing() -> None:
    bm = BlockManager(16, BS, False, "partial")
    prefill(bm, seq_of("a", list(range(1, 14))))
    assert prefill(bm, seq_of("b", list(range(1, 14)))) == 0
    assert bm.drain_events() == [] and bm.snapshot() == []


def test_reset_clears_only_when_idle() -> None:
    bm = BlockManager(16, BS, True, "partial")
    a = seq_of("a", list(range(1, 14)))
    prefill(bm, a)
    assert not bm.reset()
    bm.free(a)
    assert bm.reset()
    assert bm.snapshot() == [] and type(bm.drain_events()[-1]).__name__ == "AllBlocksCleared"
    assert prefill(bm, seq_of("b", list(range(1, 14)))) == 0


def test_abort_frees_blocks_of_running_and_waiting() -> None:
    bm = BlockManager(8, BS, True, "partial")
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    run, wait = seq_of("r", list(range(1, 20))), seq_of("w", list(range(30, 50)))
    sched.add(run)
    sched.add(wait)
    batch = sched.schedule()
    assert [item.seq for item in batch] == [run]  # w does not fit next to r
    assert bm.pool.num_free == 3
    sched.finish(run, "abort")
    assert bm.pool.num_free == 8 and run.status is SequenceStatus.FINISHED
    sched.finish(wait, "abort")
    assert not sched.has_unfinished()


def test_preemption_keeps_generated_tokens() -> None:
    bm = BlockManager(4, BS, True, "partial")
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq_of("a", list(range(1, 9))), seq_of("b", list(range(20, 28)))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert len(batch) == 2
    sched.update(batch)
    a.append_token(5, NS)
    b.append_token(6, NS)  # both need a third block for their next token: only one can grow
    batch = sched.schedule()
    a.append_token(9, NS)
    assert [item.seq for item in batch] == [a]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_tokens == 9
    assert sched.counters.num_preemptions == 1


def test_block_keys_extend_incrementally() -> None:
    s = seq_of("a", list(range(1, 8)))
    assert len(s.block_keys) == 1
    s.append_token(8, NS)
    full = seq_of("b", list(range(1, 9)))
    assert s.block_keys == full.block_keys and s.block_extra == full.block_extra
    assert isinstance(s.block_keys[0], bytes) and len(BlockKey(s.block_keys[1])) == 16


def _replay_into_index(events: list) -> tuple[BlockIndex, ReplicaId]:
    """The gateway's own index fed with a worker's events, as a subscriber would."""
    index, replica = BlockIndex(), ReplicaId("w")
    index.apply(replica, NS, events)
    return index, replica


def test_concurrent_prefills_of_one_prefix_keep_the_chain_whole() -> None:
    """Two sequences prefilled in the same step both compute their shared prefix. When the first
    one's copy is evicted, the second one's later blocks still have a cached parent: the events
    describe exactly the cache (issue 11: the gateway was one block short after such a chain)."""
    bm = BlockManager(8, BS, True, "partial")
    a = seq_of("a", [*range(1, 9), 50])
    b = seq_of("b", [*range(1, 9), 60, 61, 62, 63, 64])
    # Same step: neither sees a hit, both allocate, a finishes its prefill first.
    hits_a, hits_b = bm.find_cached_prefix(a), bm.find_cached_prefix(b)
    assert hits_a == hits_b == []
    bm.allocate(a, hits_a, a.num_tokens)
    bm.allocate(b, hits_b, b.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    b.num_computed_tokens = 8  # b's first chunk: the two shared blocks
    bm.cache_full_blocks(b)
    bm.free(a)
    # Pressure evicts a's copies of the shared blocks (and the never-used block).
    filler = seq_of("f", list(range(100, 116)))
    bm.allocate(filler, [], filler.num_tokens)
    events = bm.drain_events()
    removed = [h for ev in events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]
    assert sorted(removed) == sorted(a.block_keys[:2])
    # b's next chunk caches its third block, whose parent is the second shared block.
    b.num_computed_tokens = b.num_tokens
    bm.cache_full_blocks(b)
    assert bm.pool.lookup(b.block_keys[1]) is not None  # b's own copy keeps the parent cached

    index, replica = _replay_into_index(events + bm.drain_events())
    assert index.skipped_unknown_parent == 0
    snapshot_keys = {blk.key for blk in bm.snapshot()}
    assert snapshot_keys == set(b.block_keys)
    assert index.lookup.replica_blocks(replica) == len(snapshot_keys)
    assert all(index.lookup.holds(replica, k) for k in snapshot_keys)
    # And the worker itself still serves the whole prefix from b's copies.
    bm.free(b)
    assert prefill(bm, seq_of("c", [*range(1, 9), 60, 61, 62, 63, 70])) == 12


def test_each_copy_is_stored_and_removed_once() -> None:
    bm = BlockManager(8, BS, True, "partial")
    a, b = seq_of("a", list(range(1, 10))), seq_of("b", list(range(1, 10)))
    for s in (a, b):
        bm.allocate(s, [], s.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.cache_full_blocks(s)
    events = bm.drain_events()
    stored = [h for ev in events if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert stored == a.block_keys + b.block_keys  # two copies of each key
    assert len(bm.snapshot()) == 4 and len(bm.pool.cached) == 2
    index, replica = _replay_into_index(events)
    assert index.stats().copies == 4 and index.lookup.replica_blocks(replica) == 2
    bm.free(a)
    bm.free(b)
    bm.allocate(seq_of("f", list(range(100, 132))), [], 32)  # evicts all eight blocks
    events = bm.drain_events()
    removed = [h for ev in events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]
    assert sorted(removed) == sorted(a.block_keys + b.block_keys)
    index.apply(replica, NS, events)
    assert index.lookup.replica_blocks(replica) == 0 and index.stats().copies == 0
