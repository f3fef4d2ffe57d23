"""The host KV tier's bookkeeping: its LRU, the locks a load holds, and the CPU-tier events the
block manager publishes around it (the bytes are tested with the torch engine in
tests/worker/engine/test_host_tier_engine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachekey import HashNamespace, MMItem, Prompt
from cachekey.events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.support.engine import generate, tokens
from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.free_queue import Block
from worker.engine.host_tier import CountingCopier, HostBlock, HostTier
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence
from worker.engine.sim_runner import SimRunner

BS = 4
NS = HashNamespace("unit-model", block_size=BS)


class RecordingCopier(CountingCopier):
    def __init__(self) -> None:
        super().__init__(block_bytes=64)
        self.saves: list[tuple[int, int]] = []
        self.loads: list[tuple[int, int]] = []

    def save(self, pairs) -> None:
        self.saves += pairs

    def load(self, pairs) -> None:
        super().load(pairs)
        self.loads += pairs


def keyed(block_id: int, key: bytes, parent: bytes | None = None, depth: int = 0) -> Block:
    return Block(block_id, key=key, parent=parent, token_ids=(block_id,) * BS, depth=depth)


def test_lru_drops_the_oldest_and_a_second_offload_refreshes() -> None:
    copier = RecordingCopier()
    tier = HostTier(2, BS, copier)
    tier.offload([keyed(0, b"a")])
    tier.offload([keyed(1, b"b")])
    assert copier.saves == [(0, 0), (1, 1)]
    # A second offload of a key it holds copies nothing and makes it the newest.
    assert tier.offload([keyed(5, b"a")]) == []
    events = tier.offload([keyed(2, b"c")])  # evicts b, the oldest now
    assert list(tier.entries) == [b"a", b"c"]
    assert isinstance(events[0], BlockRemoved) and events[0].block_hashes == [b"b"]
    assert events[0].medium == "CPU"
    assert isinstance(events[1], BlockStored) and events[1].block_hashes == [b"c"]
    assert copier.saves[-1] == (2, 1)  # b's slot, reused
    assert tier.counters.evicted_blocks == 1 and tier.counters.saved_blocks == 3
    # A hit (load) makes an entry the newest too.
    a = tier.lookup(b"a")
    assert a is not None
    tier.load([a], [7])
    assert copier.loads == [(a.slot, 7)] and list(tier.entries) == [b"c", b"a"]
    assert tier.usage() == 1.0


def test_locked_entries_survive_the_offloads_a_load_causes() -> None:
    tier = HostTier(2, BS, RecordingCopier())
    tier.offload([keyed(0, b"a"), keyed(1, b"b")])
    a = tier.lookup(b"a")
    assert a is not None
    tier.lock([a])
    events = tier.offload([keyed(2, b"c"), keyed(3, b"d")])  # only b can go; d is lost
    assert set(tier.entries) == {b"a", b"c"}
    assert [type(e).__name__ for e in events] == ["BlockRemoved", "BlockStored"]
    tier.load([a], [9])  # releases the lock
    tier.offload([keyed(4, b"e")])
    assert set(tier.entries) == {b"a", b"e"}  # c was older than a (a was just loaded)


def test_offload_stores_parents_first_as_one_chain() -> None:
    tier = HostTier(8, BS, RecordingCopier())
    chain = [keyed(2, b"k2", b"k1", 2), keyed(1, b"k1", b"k0", 1), keyed(0, b"k0", None, 0)]
    (event,) = tier.offload(chain)  # the GPU frees a sequence tail first
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [b"k0", b"k1", b"k2"] and event.parent_block_hash is None
    assert event.token_ids == [0] * BS + [1] * BS + [2] * BS
    assert event.block_size == BS and event.medium == "CPU"
    # The chain's tail is the oldest: the tier drops it before its head.
    assert list(tier.entries) == [b"k2", b"k1", b"k0"]


def seq_of(rid: str, ids: list[int], mm: tuple[MMItem, ...] = (), **kw: str) -> Sequence:
    return Sequence(rid, Prompt(tuple(ids), mm), SamplingParams(), NS, **kw)


def prefill(bm: BlockManager, seq: Sequence) -> list:
    hits = bm.find_cached_prefix(seq)
    bm.allocate(seq, hits, seq.num_tokens - len(hits) * BS)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return hits


def test_eviction_goes_to_the_host_tier_and_comes_back() -> None:
    copier = RecordingCopier()
    bm = BlockManager(4, BS, True, "partial", HostTier(8, BS, copier))
    a = seq_of("a", list(range(1, 13)), lora_name="ad", cache_salt="s")  # 3 blocks
    prefill(bm, a)
    gpu_stored = bm.drain_events()
    bm.free(a)
    b = seq_of("b", list(range(50, 66)))  # 4 blocks: evicts all of a's
    prefill(bm, b)
    events = bm.drain_events()
    cpu_stored, gpu_removed = events[0], events[1]
    assert isinstance(cpu_stored, BlockStored) and cpu_stored.medium == "CPU"
    (gpu_a,) = [e for e in gpu_stored if isinstance(e, BlockStored)]
    # The same hashes, parent, tokens, extra keys and adapter as the GPU event had.
    for field in ("block_hashes", "parent_block_hash", "token_ids", "extra_keys", "lora_name"):
        assert getattr(cpu_stored, field) == getattr(gpu_a, field), field
    assert isinstance(gpu_removed, BlockRemoved) and gpu_removed.medium == "GPU"
    assert set(gpu_removed.block_hashes) == set(a.block_keys)
    bm.free(b)
    # The same prompt again: a whole hit in the host tier, copied back, not recomputed.
    again = seq_of("a2", [*range(1, 13), 99], lora_name="ad", cache_salt="s")
    hits = prefill(bm, again)
    assert [type(h) for h in hits] == [HostBlock] * 3
    assert again.num_cached_blocks >= 3 and len(copier.loads) == 3
    assert [bid for _, bid in copier.loads] == again.block_table[:3]
    reloaded = [e for e in bm.drain_events() if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert reloaded[0].block_hashes == a.block_keys


def test_host_hits_keep_the_guard_images_and_salts() -> None:
    host = HostTier(8, BS, RecordingCopier())
    bm = BlockManager(4, BS, True, "partial", host)
    img = MMItem("img-1", "image", offset=2, length=8)
    prefill(bm, a := seq_of("a", list(range(1, 13)), (img,), cache_salt="s"))
    bm.free(a)
    prefill(bm, fill := seq_of("fill", list(range(50, 66))))  # evicts a's three blocks
    bm.free(fill)
    assert set(a.block_keys) <= set(host.entries)
    ids = [*range(1, 13), 7]
    other = MMItem("img-2", "image", offset=2, length=8)
    assert bm.find_cached_prefix(seq_of("o", ids, (other,), cache_salt="s")) == []
    assert bm.find_cached_prefix(seq_of("n", ids, (img,))) == []
    assert bm.find_cached_prefix(seq_of("t", ids, (img,), cache_salt="t")) == []
    same = bm.find_cached_prefix(seq_of("s", ids, (img,), cache_salt="s"))
    assert [type(h) for h in same] == [HostBlock] * 3
    # A forged entry (same key, other tokens) is no hit in the host tier either.
    entry = host.lookup(a.block_keys[0])
    assert entry is not None
    entry.token_ids = (0,) * BS
    assert bm.find_cached_prefix(seq_of("s", ids, (img,), cache_salt="s")) == []


def test_the_gateways_hint_refreshes_a_chain_across_both_tiers() -> None:
    host = HostTier(8, BS, RecordingCopier())
    bm = BlockManager(4, BS, True, "partial", host)
    prefill(bm, a := seq_of("a", list(range(1, 13))))  # 3 blocks
    bm.free(a)
    prefill(bm, fill := seq_of("f", list(range(50, 62))))  # 3 blocks: a1, a2 go to the host
    bm.free(fill)
    assert bm.refresh_chain(a.block_keys[-1]) == 3  # a0 on the GPU, a1 and a2 in the host
    a0, a1, a2 = a.block_keys
    assert list(host.entries) == [a2, a1]  # the tail is the older
    # Refreshed, a0 is the GPU pool's newest: the next prompt evicts f's blocks, not a0.
    prefill(bm, other := seq_of("o", list(range(70, 78))))
    bm.free(other)
    f1, f2 = fill.block_keys[1:]
    assert list(host.entries) == [a2, a1, f2, f1] and bm.pool.lookup(a0) is not None
    assert bm.refresh_chain(a2) == 3
    assert list(host.entries) == [f2, f1, a2, a1]  # a's the newest, its head last
    assert bm.refresh_chain(b"no such block") == 0


def test_reset_clears_both_tiers() -> None:
    tier = HostTier(8, BS, RecordingCopier())
    bm = BlockManager(2, BS, True, "partial", tier)
    prefill(bm, a := seq_of("a", list(range(1, 9))))
    bm.free(a)
    prefill(bm, b := seq_of("b", list(range(20, 28))))
    bm.free(b)
    assert tier.entries and bm.reset()
    assert not tier.entries and isinstance(bm.drain_events()[-1], AllBlocksCleared)
    assert bm.find_cached_prefix(seq_of("a", [*range(1, 9), 1])) == []


def test_sim_engine_tier_hits_and_charges_the_copy_back(demo_model_dir: Path) -> None:
    """The sim engine: the same tier; a host hit is cached tokens, its copy is charged."""
    kw = {"engine": "sim", "num_blocks": 8, "sim_preset": "h200-llama-1b", "sim_server_scale": 0}
    on = LLMEngine(EngineConfig(model=str(demo_model_dir), kv_offload_bytes=64 << 20, **kw))
    off = LLMEngine(EngineConfig(model=str(demo_model_dir), **kw))
    assert on.block_manager.host is not None
    assert on.block_manager.host.num_slots == (64 << 20) // (16 * 32768)
    prompts = [on.renderer.render_completion(f"Prompt {i}: " + "words " * 40) for i in range(2)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    results = []
    for engine in (on, off):
        outs = [generate(engine, f"r{i}", prompts[i % 2], params) for i in range(3)]
        results.append(outs)
    (a, _, a2), (ref_a, _, ref_a2) = results
    assert tokens(a2) == tokens(a) == tokens(ref_a) == tokens(ref_a2)
    n = len(prompts[0].token_ids)
    assert a2[-1].num_cached_tokens == (n - 1) // 16 * 16  # from the host tier
    assert ref_a2[-1].num_cached_tokens == 0  # the GPU alone lost it
    stats = on.scheduler.counters
    assert stats.host_hits_tokens == a2[-1].num_cached_tokens
    runner = on.runner
    assert isinstance(runner, SimRunner) and runner.offload is not None
    assert runner.offload.pending_loads == 0  # charged in the step that needed them
    assert runner.step_cost is not None
    # 8,000 tokens of llama-1b K/V (250 MiB) back in the measured 4.88 ms for 256 MiB.
    assert abs(runner.step_cost.host_load(8000) - 8000 * 32768 * 4.88e-3 / (256 << 20)) < 1e-9
    mediums = {(type(e).__name__, e.medium) for e in on.drain_events() if hasattr(e, "medium")}
    assert ("BlockStored", "CPU") in mediums and ("BlockRemoved", "GPU") in mediums


def test_sim_tier_needs_a_size_it_can_count(demo_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="--kv-offload-blocks"):
        LLMEngine(EngineConfig(model=str(demo_model_dir), engine="sim", kv_offload_bytes=1 << 20))
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(model="x", kv_offload_blocks=4, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no block"):
        preset = {"sim_preset": "h200-llama-1b", "kv_offload_bytes": 1000}
        LLMEngine(EngineConfig(model=str(demo_model_dir), engine="sim", **preset))
    with pytest.raises(ValueError, match="kv_offload_bytes must be >= 0"):
        EngineConfig(model="x", kv_offload_bytes=-1)
    engine = LLMEngine(EngineConfig(model=str(demo_model_dir), engine="sim", kv_offload_blocks=5))
    assert engine.block_manager.host is not None and engine.block_manager.host.num_slots == 5
