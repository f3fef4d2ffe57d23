"""BlockIndex: which replicas hold which block keys, rebuilt exactly from the workers' KV events.

Dual keys: events carry engine hashes (kvgate's BlockKey bytes, or vLLM's ints), but the index is
keyed by the gateway's own keys, recomputed with `cachekey.hash_block` from each event's token
ids and extra keys. Each replica keeps engine hash -> gateway key so that removals and children
(whose parent is named by engine hash) resolve. Memory is bounded by an LRU over gateway keys.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NewType

from cachekey.events import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, KVEvent
from cachekey.keys import HashNamespace, hash_block
from cachekey.types import BlockKey

ReplicaId = NewType("ReplicaId", str)

# Rough CPython costs (bytes) of one key entry, one (key, replica) copy and one engine-hash map
# entry; measured once with sys.getsizeof on 64-bit CPython 3.11, good to about +-20%.
_BYTES_PER_KEY = 16 + 33 + 104 + 64
_BYTES_PER_COPY = 72
_BYTES_PER_ENGINE_ENTRY = 16 + 33 + 72


@dataclass(slots=True)
class _Copy:
    """One replica's hold on a gateway key: how many engine copies, and the engine hash."""

    count: int
    engine_hash: EngineHash


@dataclass(slots=True)
class _ReplicaState:
    engine_to_key: dict[EngineHash, BlockKey] = field(default_factory=dict)
    num_blocks: int = 0


@dataclass(slots=True)
class IndexStats:
    blocks: int
    copies: int
    bytes: int
    skipped_unknown_parent: int
    skipped_bad_event: int


class BlockIndex:
    """Gateway key -> replicas holding it, with per-copy counts and TTL'd speculative entries."""

    def __init__(self, max_blocks: int = 1_000_000, speculative_ttl: float = 2.0) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self.speculative_ttl = speculative_ttl
        self._holders: OrderedDict[BlockKey, dict[ReplicaId, _Copy]] = OrderedDict()
        self._replicas: dict[ReplicaId, _ReplicaState] = {}
        self._spec: dict[BlockKey, dict[ReplicaId, float]] = {}
        self._spec_expiry: deque[tuple[float, BlockKey, ReplicaId]] = deque()
        self._copies = 0
        self.skipped_unknown_parent = 0
        self.skipped_bad_event = 0

    # ---- ingestion -------------------------------------------------------------------------

    def apply(self, replica: ReplicaId, ns: HashNamespace, events: Iterable[KVEvent]) -> int:
        """Apply one batch of events in order; returns how many events were applied."""
        applied = 0
        for ev in events:
            if isinstance(ev, BlockStored):
                applied += self.store(replica, ns, ev)
            elif isinstance(ev, BlockRemoved):
                self.remove(replica, ev.block_hashes)
                applied += 1
            elif isinstance(ev, AllBlocksCleared):
                self.drop_replica(replica)
                applied += 1
        return applied

    def store(self, replica: ReplicaId, ns: HashNamespace, ev: BlockStored) -> bool:
        state = self._replicas.setdefault(replica, _ReplicaState())
        bs = ev.block_size
        if bs != ns.block_size or len(ev.token_ids) != bs * len(ev.block_hashes):
            self.skipped_bad_event += 1
            return False
        if ev.parent_block_hash is None:
            parent = ns.root()
        else:
            known = state.engine_to_key.get(ev.parent_block_hash)
            if known is None:
                # Never re-anchor at the root: the keys would be wrong, not merely missing.
                self.skipped_unknown_parent += 1
                return False
            parent = known
        extras = ev.extra_keys
        for i, engine_hash in enumerate(ev.block_hashes):
            extra = extras[i] if extras is not None and i < len(extras) else None
            parent = hash_block(parent, ev.token_ids[i * bs : (i + 1) * bs], extra)
            self._add_copy(replica, state, parent, engine_hash)
        self._evict_over_cap()
        return True

    def _add_copy(
        self, replica: ReplicaId, state: _ReplicaState, key: BlockKey, engine_hash: EngineHash
    ) -> None:
        holders = self._holders.get(key)
        if holders is None:
            holders = self._holders[key] = {}
        else:
            self._holders.move_to_end(key)
        copy = holders.get(replica)
        if copy is None:
            holders[replica] = _Copy(1, engine_hash)
            state.num_blocks += 1
        else:
            copy.count += 1
        state.engine_to_key[engine_hash] = key
        self._copies += 1
        spec = self._spec.get(key)
        if spec is not None:
            spec.pop(replica, None)  # the real event replaces the guess
            if not spec:
                del self._spec[key]  # an empty map would stay forever (its expiry is moot)

    def remove(self, replica: ReplicaId, engine_hashes: Sequence[EngineHash]) -> None:
        state = self._replicas.get(replica)
        if state is None:
            return
        for engine_hash in engine_hashes:
            key = state.engine_to_key.get(engine_hash)
            if key is None:
                continue
            holders = self._holders.get(key)
            copy = holders.get(replica) if holders is not None else None
            if copy is None:
                state.engine_to_key.pop(engine_hash, None)
                continue
            copy.count -= 1
            self._copies -= 1
            if copy.count <= 0:
                del holders[replica]
                state.num_blocks -= 1
                state.engine_to_key.pop(engine_hash, None)
                if not holders:
                    del self._holders[key]

    def drop_replica(self, replica: ReplicaId) -> None:
        """Forget everything a replica holds (AllBlocksCleared, resync, removal, death)."""
        state = self._replicas.pop(replica, None)
        if state is not None:
            for key in set(state.engine_to_key.values()):
                holders = self._holders.get(key)
                if holders is None:
                    continue
                copy = holders.pop(replica, None)
                if copy is not None:
                    self._copies -= copy.count
                if not holders:
                    del self._holders[key]
        for key in [k for k, spec in self._spec.items() if replica in spec]:
            spec = self._spec[key]
            del spec[replica]
            if not spec:
                del self._spec[key]

    def _evict_over_cap(self) -> None:
        while len(self._holders) > self.max_blocks:
            _, holders = self._holders.popitem(last=False)
            for replica, copy in holders.items():
                self._copies -= copy.count
                state = self._replicas.get(replica)
                if state is not None:
                    state.num_blocks -= 1
                    state.engine_to_key.pop(copy.engine_hash, None)

    # ---- speculative entries ---------------------------------------------------------------

    def add_speculative(
        self, replica: ReplicaId, keys: Sequence[BlockKey], now: float | None = None
    ) -> None:
        """Guess that `replica` will hold `keys` soon (the request was just routed there)."""
        now = time.monotonic() if now is None else now
        self._expire_speculative(now)
        expiry = now + self.speculative_ttl
        for key in keys:
            holders = self._holders.get(key)
            if holders is not None and replica in holders:
                continue
            self._spec.setdefault(key, {})[replica] = expiry
            self._spec_expiry.append((expiry, key, replica))

    def _expire_speculative(self, now: float) -> None:
        q = self._spec_expiry
        while q and q[0][0] <= now:
            expiry, key, replica = q.popleft()
            spec = self._spec.get(key)
            if spec is not None and spec.get(replica) == expiry:
                del spec[replica]
                if not spec:
                    del self._spec[key]

    # ---- lookup ----------------------------------------------------------------------------

    def match(
        self,
        keys: Sequence[BlockKey],
        replicas: Iterable[ReplicaId],
        *,
        speculative: bool = True,
        now: float | None = None,
    ) -> dict[ReplicaId, int]:
        """Blocks of the longest consecutive prefix of `keys` (from block 0) held by each replica.

        One pass over the keys; a replica drops out at its first miss, and the scan stops when
        none is left.
        """
        alive = set(replicas)
        result = dict.fromkeys(alive, 0)
        if speculative and self._spec:
            now = time.monotonic() if now is None else now
            self._expire_speculative(now)
        spec_map = self._spec if speculative else {}
        for i, key in enumerate(keys):
            holders = self._holders.get(key)
            spec = spec_map.get(key)
            gone = [r for r in alive if not ((holders and r in holders) or (spec and r in spec))]
            for r in gone:
                result[r] = i
                alive.discard(r)
            if not alive:
                return result
        for r in alive:
            result[r] = len(keys)
        return result

    def holds(self, replica: ReplicaId, key: BlockKey) -> bool:
        holders = self._holders.get(key)
        return holders is not None and replica in holders

    # ---- introspection ---------------------------------------------------------------------

    def replica_blocks(self, replica: ReplicaId) -> int:
        state = self._replicas.get(replica)
        return state.num_blocks if state is not None else 0

    def replica_digest(self, replica: ReplicaId) -> str:
        """Order-independent digest of the gateway keys a replica holds (for comparing indexes)."""
        state = self._replicas.get(replica)
        keys = sorted(set(state.engine_to_key.values())) if state is not None else []
        h = hashlib.sha256()
        for key in keys:
            if self.holds(replica, key):
                h.update(key)
        return h.hexdigest()

    def replica_keys(self, replica: ReplicaId) -> set[BlockKey]:
        state = self._replicas.get(replica)
        if state is None:
            return set()
        return {k for k in state.engine_to_key.values() if self.holds(replica, k)}

    def stats(self) -> IndexStats:
        engine_entries = sum(len(s.engine_to_key) for s in self._replicas.values())
        n = len(self._holders)
        return IndexStats(
            blocks=n,
            copies=self._copies,
            bytes=n * _BYTES_PER_KEY
            + self._copies * _BYTES_PER_COPY
            + engine_entries * _BYTES_PER_ENGINE_ENTRY,
            skipped_unknown_parent=self.skipped_unknown_parent,
            skipped_bad_event=self.skipped_bad_event,
        )

    def __len__(self) -> int:
        return len(self._holders)
