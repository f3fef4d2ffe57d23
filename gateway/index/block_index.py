"""BlockIndex: which replicas hold which block keys, rebuilt exactly from the workers' KV events.

Dual keys: events carry engine hashes (kvgate's BlockKey bytes, or vLLM's ints), but the index is
keyed by the gateway's own keys, recomputed from each event's token ids and extra keys
(`cachekey.chain_keys`). Each replica keeps engine hash -> gateway key so that removals and
children (whose parent is named by engine hash) resolve.

Compact: one dict entry per key whose value is a bitmask of *slots*; a slot is one KV-cache group
of one replica (a plain model has one group; a hybrid model a full-attention and a sliding-window
group). A second copy of a key in a slot is counted in a small side table. A replica is an opaque
id, so a (worker, data-parallel rank) pair can be one. Insertion order is the LRU order (a store
re-inserts its key), and the oldest keys go in batches when the cap is passed.

Copies (docs/gateway.md, "vLLM workers"): every kvgate `BlockStored` is one more copy (a key
computed twice in one step is cached twice). vLLM's `kv_cache_report_mode="full"` re-announces
the blocks a request hit as a `BlockStored` from block 0 (no parent); for a replica marked as
re-announcing, such a store of a block the slot already holds is not a new copy.

Tiers: a replica's host-memory tier (`medium: "CPU"`) is one more slot of it (`HOST_GROUP`): a
block may be in both tiers; `IndexLookup.hits` follows it past the GPU's hit.

Thread safety: events are hashed and applied on an ingestion thread while `match` runs on the
event loop. Mutations take `_lock`; `match` reads without it (single dict reads and ints, and
per-replica tuples replaced whole), taking the lock only to expire speculative entries.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence

from cachekey.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from cachekey.keys import HashNamespace
from cachekey.types import BlockKey
from gateway.index.eviction import evict_oldest, forget_blocks
from gateway.index.lookup import IndexLookup, IndexStats, IndexTables
from gateway.index.replica_blocks import (
    HOST_GROUP,
    ReplicaBlocks,
    is_sparse,
    stored_keys,
    tier_group,
)
from gateway.index.speculative import Guess, SpeculativeEntries
from gateway.names import ReplicaId


class BlockIndex:
    """Gateway key -> slots holding it, with per-copy counts and TTL'd speculative entries: its
    state (`IndexTables`) and every change to it; its reads are `lookup` (lookup.py)."""

    def __init__(self, max_blocks: int = 1_000_000, speculative_ttl: float = 2.0) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self.speculative_ttl = speculative_ttl
        self._extra: dict[tuple[BlockKey, int], int] = {}  # (key, slot bit) -> copies beyond 1
        self._reannouncing: set[ReplicaId] = set()
        self._free_slots: list[int] = []
        self._next_slot = 0
        lock = threading.Lock()
        self._t = IndexTables(lock, SpeculativeEntries(speculative_ttl, lock))
        self.lookup = IndexLookup(self._t)
        self._traits: dict[ReplicaId, tuple[bool, int | None]] = {}  # (defers, num_blocks)
        self._copies = 0
        self.skipped_unknown_parent = 0
        self.other_tier_events = 0
        self.errors: Counter[str] = Counter()

    def set_reannouncing(self, replica: ReplicaId, on: bool = True) -> None:
        """Mark a replica whose parentless stores may re-announce held blocks (plain vLLM)."""
        (self._reannouncing.add if on else self._reannouncing.discard)(replica)

    def set_traits(self, replica: ReplicaId, defers: bool, num_blocks: int | None) -> None:
        """What speculative entries need to know of a replica's worker: whether it defers a
        request whose prefix another running request is computing, and its cache size."""
        self._traits[replica] = (defers, num_blocks)

    # ---- ingestion -------------------------------------------------------------------------

    def apply(self, replica: ReplicaId, ns: HashNamespace, events: Iterable[KVEvent]) -> int:
        """Apply one batch of events in order; returns how many events were applied.

        A sparse group's store (`is_sparse`) names its blocks by engine hash only. vLLM caches a
        step's groups in order, so a hybrid model's sliding-window group (often group 0) names
        blocks that the full-attention group's store later in the same batch keys: such a store
        waits for the batch's next dense store, or its end."""
        applied = 0
        waiting: list[BlockStored] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                if is_sparse(ev):
                    if self.store_sparse(replica, ev, final=False):
                        applied += 1
                    else:
                        waiting.append(ev)
                    continue
                applied += self.store(replica, ns, ev)
                if waiting:
                    still = [w for w in waiting if not self.store_sparse(replica, w, final=False)]
                    applied += len(waiting) - len(still)
                    waiting = still
            elif isinstance(ev, BlockRemoved):
                applied += self.remove(replica, ev.block_hashes, ev.group_idx, ev.medium)
            elif isinstance(ev, AllBlocksCleared):
                self.drop_replica(replica)
                waiting.clear()
                applied += 1
        for ev in waiting:
            applied += self.store_sparse(replica, ev, final=True)
        return applied

    def store(self, replica: ReplicaId, ns: HashNamespace, ev: BlockStored) -> bool:
        tier = tier_group(ev.medium, ev.group_idx)
        self.other_tier_events += tier is None
        if tier is None:
            return False
        if tier == HOST_GROUP and replica in self._reannouncing:
            return self.store_sparse(replica, ev, final=True)
        bs = ev.block_size
        if bs != ns.block_size or len(ev.token_ids) != bs * len(ev.block_hashes):
            self.errors["length_mismatch" if bs == ns.block_size else "block_size"] += 1
            return False
        rep = self._t.replicas.get(replica) or self._add_replica(replica)
        if ev.parent_block_hash is None:
            parent = ns.root()
        else:
            known = rep.engine.get(ev.parent_block_hash)
            if known is None:
                # Never re-anchor at the root: the keys would be wrong, not merely missing.
                self.skipped_unknown_parent += 1
                return False
            parent = known if type(known) is bytes else known[0]
        try:
            keys, held_as = stored_keys(ev, parent)
        except (OverflowError, TypeError):
            self.errors["bad_token_ids"] += 1
            return False
        hkeys = keys if held_as is None else held_as
        values = keys if held_as is None else list(zip(keys, held_as, strict=True))
        hashes = ev.block_hashes
        if hashes and type(hashes[0]) is bytes:  # a kvgate worker: its hashes are our keys
            hashes = [k if h == k else h for h, k in zip(hashes, keys, strict=True)]
        with self._t.lock:
            if self._t.replicas.get(replica) is not rep:
                return False  # dropped while we hashed
            if held_as is not None:
                rep.lookahead = len(ev.lookahead_token_ids[0]) if ev.lookahead_token_ids else 0
                if rep.lookahead and rep not in self._t.lookahead:
                    self._t.lookahead = (*self._t.lookahead, rep)
            self._add_copies(rep, ev, tier, hashes, hkeys, values)
            self._evict_over_cap()
        return True

    def store_sparse(self, replica: ReplicaId, ev: BlockStored, *, final: bool) -> bool:
        """A store by engine hash: a sparse group's, and plain vLLM's host tier's (its events
        carry no extra keys, so its keys are never recomputed: no image or salt is lost). Its
        keys are those the replica's GPU groups stored under the same engine hashes (vLLM hashes
        a block alike in every group and tier). False, unless `final`, while one is still
        unknown; when `final`, the known ones are stored, the rest skipped (never guessed)."""
        tier = tier_group(ev.medium, ev.group_idx)
        self.other_tier_events += tier is None
        if tier is None:
            return True
        rep = self._t.replicas.get(replica) or self._add_replica(replica)
        engine = rep.engine
        values = [engine.get(h) for h in ev.block_hashes]
        if None in values:
            if not final:
                return False
            self.skipped_unknown_parent += values.count(None)
        known = [(h, v) for h, v in zip(ev.block_hashes, values, strict=True) if v is not None]
        hkeys = [v if type(v) is bytes else v[1] for _, v in known]
        with self._t.lock:
            if self._t.replicas.get(replica) is rep:
                hashes = [h for h, _ in known]
                self._add_copies(rep, ev, tier, hashes, hkeys, [v for _, v in known])
        return True

    def _add_copies(
        self,
        rep: ReplicaBlocks,
        ev: BlockStored,
        tier: int,
        hashes: Sequence,
        hkeys: Sequence[BlockKey],
        values: Sequence,
    ) -> None:
        """Each block one more copy in group `tier`: engine hash -> value (the key, or (key,
        lookahead key)), held as `hkeys`. A host store is never vLLM's re-announcement."""
        rep.block_size = ev.block_size
        host = tier == HOST_GROUP
        kind, window = (
            (None, None) if host else (ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window)
        )
        group = rep.group(tier, kind, window)
        if host:
            rep.set_host_rule(gpu_after_host=rep.id not in self._reannouncing)
        self._t.by_bit[group.bit] = rep
        bit = group.bit
        reannounce = not host and ev.parent_block_hash is None and rep.id in self._reannouncing
        held, engine, spec, extra = self._t.held, rep.engine, self._t.spec.mask, self._extra
        new = dup = 0
        for engine_hash, hkey, value in zip(hashes, hkeys, values, strict=True):
            mask = held.pop(hkey, 0)  # pop + insert: the key becomes the newest
            if not mask & bit:
                held[hkey] = mask | bit
                new += 1
            else:
                held[hkey] = mask
                if not reannounce:
                    extra[(hkey, bit)] = extra.get((hkey, bit), 0) + 1
                    dup += 1
            engine[engine_hash] = value
            if spec and hkey in spec:
                self._t.spec.confirm(hkey, rep.home_bit)  # the real event replaces the guess
        group.blocks += new
        self._copies += new + dup
        if len(engine) > 2 * rep.blocks() + 1024:
            rep.sweep_engine(held)

    def remove(
        self,
        replica: ReplicaId,
        engine_hashes: Sequence,
        group_idx: int | None = None,
        medium: str | None = "GPU",
    ) -> bool:
        tier = tier_group(medium, group_idx)
        self.other_tier_events += tier is None
        if tier is None:
            return False
        rep = self._t.replicas.get(replica)
        group = rep.groups.get(tier) if rep is not None else None
        if group is None:
            return True  # nothing held there
        bit, held, engine, spec = group.bit, self._t.held, rep.engine, self._t.spec
        with self._t.lock:
            for engine_hash in engine_hashes:
                value = engine.get(engine_hash)
                if value is None:
                    continue
                hkey = value if type(value) is bytes else value[1]
                mask = held.get(hkey, 0)
                if not mask & bit:
                    continue
                self._copies -= 1
                extra = self._extra.pop((hkey, bit), 0)
                if extra > 1:
                    self._extra[(hkey, bit)] = extra - 1
                if extra:
                    continue
                mask &= ~bit
                group.blocks -= 1
                if bit == rep.home_bit and hkey in spec.mask:
                    spec.confirm(hkey, bit)  # gone from the GPU: a guess must not outlive it
                if mask:
                    held[hkey] = mask
                else:
                    del held[hkey]
                if not mask & rep.all_bits:
                    del engine[engine_hash]
        return True

    def drop_replica(self, replica: ReplicaId) -> None:
        """Forget everything a replica holds (AllBlocksCleared, resync, removal, death)."""
        with self._t.lock:
            rep = self._t.replicas.pop(replica, None)
            if rep is None:
                return
            self._copies -= forget_blocks(self._t.held, self._extra, rep)
            self._t.spec.drop(rep.home_bit)
            self._free_slots.extend(rep.slots())
            for group in rep.groups.values():
                self._t.by_bit.pop(group.bit, None)
            if rep in self._t.lookahead:
                self._t.lookahead = tuple(r for r in self._t.lookahead if r is not rep)

    def _add_replica(self, replica: ReplicaId) -> ReplicaBlocks:
        with self._t.lock:
            rep = self._t.replicas.get(replica)
            if rep is None:
                rep = self._t.replicas[replica] = ReplicaBlocks(replica, self._take_slot)
                self._t.by_bit[rep.home_bit] = rep
            return rep

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop(0)
        self._next_slot += 1
        return self._next_slot - 1

    def _evict_over_cap(self) -> None:
        if len(self._t.held) > self.max_blocks:
            self._copies -= evict_oldest(self._t, self._extra, self.max_blocks)

    # ---- speculative entries (gateway/index/speculative.py) ------------------------------------

    def speculate(
        self, replica: ReplicaId, keys: Sequence[BlockKey], now: float | None = None
    ) -> Guess:
        """Guess that `replica` will hold `keys` soon (a request was just routed there). The
        returned `Guess` is the request's handle: `show`, `release` or `discard` it."""
        now = time.monotonic() if now is None else now
        rep = self._t.replicas.get(replica) or self._add_replica(replica)
        defers, capacity = self._traits.get(replica, (True, None))
        with self._t.lock:
            return self._t.spec.add(rep.home_bit, keys, self._t.held, defers, capacity, now)

    def __len__(self) -> int:
        return len(self._t.held)

    @property
    def skipped_bad_event(self) -> int:
        return sum(self.errors.values())

    def stats(self) -> IndexStats:
        return self.lookup.stats(self._copies, self.skipped_unknown_parent, self.skipped_bad_event)
