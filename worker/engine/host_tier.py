"""HostTier: the second KV tier, evicted GPU blocks kept in host memory by their block hash.

When the GPU pool reuses a cached block, its K/V is copied here first (`offload`); a prefix
lookup that runs past the GPU's cached blocks continues here, and the blocks it finds are copied
back into fresh GPU blocks instead of being recomputed (`load`). The tier has an LRU of its own
(a hit or a second offload makes an entry the newest) and reports what it holds as vLLM's
offloading connector does: BlockStored / BlockRemoved with `medium: "CPU"`, carrying the same
hash, parent, token ids, extra keys and LoRA name as the GPU block's own event, so a gateway
keys both tiers alike (and an image's blocks keep its identity in both).

The bookkeeping here is torch-free: the bytes move through a `KVCopier` (host_copy.py for the
torch engine; `CountingCopier`, which moves nothing, for the sim engine and the unit tests).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cachekey import BlockKey
from cachekey.events import BlockRemoved, BlockStored, KVEvent
from cachekey.types import ExtraKey
from worker.engine.free_queue import Block

MEDIUM_CPU = "CPU"


class KVCopier(Protocol):
    """Moves blocks' K/V between the device cache and host slots."""

    block_bytes: int

    @property
    def load_seconds(self) -> float | None:
        """Seconds the loads (host -> device) took so far: vLLM's `vllm:kv_offload_load_time`,
        which a gateway divides by the host-tier hits to price a host hit per replica. None:
        not timed (the sim engine without a preset, whose copies are free)."""

    def save(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device block id, host slot) each: copy out before the device block is reused."""

    def load(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host slot, device block id) each: copy back before the step that reads them."""


class CountingCopier:
    """Moves nothing; counts the blocks that would move (the sim engine charges their time)."""

    def __init__(self, block_bytes: int = 0, *, timed: bool = False) -> None:
        self.block_bytes = block_bytes
        self.pending_loads = 0  # blocks loaded since the runner last charged them
        # The time the runner charged for them; None when it charges none.
        self.load_seconds: float | None = 0.0 if timed else None

    def save(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass

    def load(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.pending_loads += len(pairs)

    def take_loads(self) -> int:
        n, self.pending_loads = self.pending_loads, 0
        return n

    def charge(self, seconds: float) -> None:
        """The runner's time for the loads it took (only a timed copier is charged)."""
        assert self.load_seconds is not None
        self.load_seconds += seconds


@dataclass(slots=True, eq=False)
class HostBlock:
    """A block's K/V in host slot `slot`, and what its GPU copy was registered with."""

    key: BlockKey
    slot: int
    parent: BlockKey | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[ExtraKey, ...]
    lora_name: str | None
    depth: int


@dataclass(slots=True)
class HostCounters:
    saved_blocks: int = 0  # GPU -> host copies
    loaded_blocks: int = 0  # host -> GPU copies
    evicted_blocks: int = 0  # dropped by the tier's own LRU


class HostTier:
    def __init__(self, num_slots: int, block_size: int, copier: KVCopier) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier holds no block ({num_slots} slots)")
        self.num_slots = num_slots
        self.block_size = block_size
        self.copier = copier
        self.entries: OrderedDict[BlockKey, HostBlock] = OrderedDict()  # oldest first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        # Entries a load in progress reads: the offloads that load's allocation causes must
        # not evict them from under it.
        self._locked: set[BlockKey] = set()
        self.counters = HostCounters()

    def usage(self) -> float:
        return len(self.entries) / self.num_slots

    def stats(self) -> dict[str, float | None]:
        """EngineStats' host_* fields the tier itself knows."""
        nbytes = self.copier.block_bytes
        return {
            "host_saved_bytes": self.counters.saved_blocks * nbytes,
            "host_loaded_bytes": self.counters.loaded_blocks * nbytes,
            "host_load_seconds": self.copier.load_seconds,
            "host_num_blocks": self.num_slots,
            "host_cache_usage": self.usage(),
        }

    def lookup(self, key: BlockKey) -> HostBlock | None:
        return self.entries.get(key)

    def refresh(self, entries: Sequence[HostBlock]) -> None:
        """Make `entries` the newest, the first of them last of all (a chain's tail goes
        before its head, as in the GPU pool)."""
        for entry in reversed(entries):
            self.entries.move_to_end(entry.key)

    def offload(self, blocks: Sequence[Block]) -> list[KVEvent]:
        """Copy keyed GPU blocks about to be reused; the events it causes, in order (the LRU's
        removals, then the stores). A key already here is only made the newest."""
        pairs: list[tuple[int, int]] = []
        stored: list[HostBlock] = []
        removed: list[BlockKey] = []
        fresh: set[BlockKey] = set()
        # Parents first, so a chain's BlockStored never names a parent stored after it.
        for block in sorted(blocks, key=lambda b: b.depth):
            assert block.key is not None
            if block.key in self.entries:
                self.entries.move_to_end(block.key)
                continue
            slot = self._free_slot(removed, fresh)
            if slot is None:
                continue  # every entry is locked by a load or this batch's: the block is lost
            entry = HostBlock(
                block.key,
                slot,
                block.parent,
                block.token_ids,
                block.extra_keys,
                block.lora_name,
                block.depth,
            )
            self.entries[block.key] = entry
            fresh.add(block.key)
            pairs.append((block.block_id, slot))
            stored.append(entry)
        self.refresh(stored)  # parents newest: a chain's tail is dropped before its head
        self.copier.save(pairs)
        self.counters.saved_blocks += len(pairs)
        events: list[KVEvent] = []
        if removed:
            events.append(BlockRemoved(block_hashes=list(removed), medium=MEDIUM_CPU))
        events += stored_events(stored, self.block_size)
        return events

    def lock(self, entries: Sequence[HostBlock]) -> None:
        self._locked.update(e.key for e in entries)

    def load(self, entries: Sequence[HostBlock], block_ids: Sequence[int]) -> None:
        """Copy `entries` into GPU blocks `block_ids`; they stay here too, now the newest."""
        self.copier.load([(e.slot, b) for e, b in zip(entries, block_ids, strict=True)])
        self.counters.loaded_blocks += len(entries)
        self.refresh(entries)
        self._locked.clear()

    def clear(self) -> None:
        """Forget every entry (a prefix-cache reset; its AllBlocksCleared covers both tiers)."""
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self.entries.clear()
        self._locked.clear()

    def _free_slot(self, removed: list[BlockKey], fresh: set[BlockKey]) -> int | None:
        """A free slot, or the oldest evictable entry's (never one a load holds, nor one this
        offload just stored: its BlockStored is not out yet)."""
        if self._free_slots:
            return self._free_slots.pop()
        for key, entry in self.entries.items():
            if key not in self._locked and key not in fresh:
                del self.entries[key]
                removed.append(key)
                self.counters.evicted_blocks += 1
                return entry.slot
        return None


def stored_events(entries: Sequence[HostBlock], block_size: int) -> list[BlockStored]:
    """One CPU BlockStored per run of entries that chain parent to child under one adapter."""
    events: list[BlockStored] = []
    run: list[HostBlock] = []
    for entry in entries:
        if run and (entry.parent != run[-1].key or entry.lora_name != run[-1].lora_name):
            events.append(_stored(run, block_size))
            run = []
        run.append(entry)
    if run:
        events.append(_stored(run, block_size))
    return events


def _stored(run: list[HostBlock], block_size: int) -> BlockStored:
    return BlockStored(
        block_hashes=[e.key for e in run],
        parent_block_hash=run[0].parent,
        token_ids=[t for e in run for t in e.token_ids],
        block_size=block_size,
        medium=MEDIUM_CPU,
        lora_name=run[0].lora_name,
        extra_keys=[e.extra_keys or None for e in run],
    )
