"""IndexLookup: the index's reads, on the request path (`match`, `hits`) and for operators
(per-replica counts and digests), over `IndexTables`, the index's state. BlockIndex
(block_index.py) owns the tables and every change to them, and holds its IndexLookup; the reads
run on the event loop without the lock (see its docstring).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cachekey.types import BlockKey, MMItem
from gateway.index.replica_blocks import HOST_GROUP, ReplicaBlocks
from gateway.index.speculative import SpeculativeEntries
from gateway.names import ReplicaId

# CPython bytes per indexed block, measured with tracemalloc by bench/index_ingest.py on 64-bit
# CPython 3.11 (int engine hashes, one replica): the key dict entry with its 16-byte key, and
# the engine-hash map entry with its int. Good to about +-15%.
_BYTES_PER_KEY = 110
_BYTES_PER_ENGINE_ENTRY = 95


@dataclass(slots=True)
class IndexStats:
    blocks: int
    copies: int
    bytes: int
    skipped_unknown_parent: int
    skipped_bad_event: int


@dataclass(slots=True, eq=False)
class IndexTables:
    """The index's state: BlockIndex changes it under `lock`; IndexLookup reads it."""

    lock: threading.Lock
    spec: SpeculativeEntries  # gateway/index/speculative.py
    held: dict[BlockKey, int] = field(default_factory=dict)  # key -> the slots holding it
    replicas: dict[ReplicaId, ReplicaBlocks] = field(default_factory=dict)
    # Slot bit -> its replica, and the replicas with lookahead keys (replaced whole): a match
    # looks only at the replicas holding a request's block 0, and at those.
    by_bit: dict[int, ReplicaBlocks] = field(default_factory=dict)
    lookahead: tuple[ReplicaBlocks, ...] = ()


class IndexLookup:
    """The reads of one index's tables."""

    __slots__ = ("_t",)

    def __init__(self, tables: IndexTables) -> None:
        self._t = tables

    # ---- lookup ----------------------------------------------------------------------------

    def match(
        self,
        keys: Sequence[BlockKey],
        replicas: Iterable[ReplicaId],
        *,
        speculative: bool = True,
        now: float | None = None,
        tokens: Sequence[int] | None = None,
        mm_items: Sequence[MMItem] = (),
    ) -> dict[ReplicaId, int]:
        """Blocks of the longest prefix of `keys` (from block 0) each of `replicas` would hit,
        0 for none (`hits` has the arguments)."""
        found = self.hits(keys, speculative=speculative, now=now, tokens=tokens, mm_items=mm_items)
        return {r: found.get(r, 0) for r in replicas}

    def hits(
        self,
        keys: Sequence[BlockKey],
        *,
        speculative: bool = True,
        now: float | None = None,
        tokens: Sequence[int] | None = None,
        mm_items: Sequence[MMItem] = (),
        gpu: dict[ReplicaId, int] | None = None,
    ) -> dict[ReplicaId, int]:
        """The replicas that would hit at least block 0 of `keys`, and how many blocks.

        Only the replicas holding block 0 (or guessed to, `speculative`) can, and those with
        lookahead keys (EAGLE/MTP, whose hit needs the request's `tokens`): a replica that
        holds nothing of the request costs nothing. One pass over the keys for all of their
        full-attention slots at once: a slot drops out at its first miss. Then per replica,
        where it applies, the sliding-window rule of a hybrid model, and with `gpu` (a dict it
        fills with the GPU's part of each host-tier replica's hit) the host tier past the GPU's
        hit (`host_extent`); without it (`--ignore-host-tier`) the GPU's hit alone."""
        now = time.monotonic() if now is None else now
        t = self._t
        if speculative and t.spec.due(now):
            with t.lock:
                t.spec.expire(now)
        spec = t.spec.mask if speculative else None
        held = t.held
        by_bit = t.by_bit
        reps: dict[ReplicaId, ReplicaBlocks] = {r.id: r for r in t.lookahead}
        first = (held.get(keys[0], 0) | (spec.get(keys[0], 0) if spec else 0)) if keys else 0
        alive = 0
        while first:
            bit = first & -first
            first ^= bit
            rep = by_bit.get(bit)
            if rep is not None and rep.id not in reps:
                reps[rep.id] = rep
                alive |= rep.full_bits
        stops: dict[int, int] = {}
        for i, key in enumerate(keys):
            if not alive:
                break
            mask = held.get(key, 0)
            if spec:
                mask |= spec.get(key, 0)
            kept = alive & mask
            if kept != alive:
                gone, alive = alive ^ kept, kept
                while gone:
                    bit = gone & -gone
                    gone ^= bit
                    stops[bit] = i
        found = {}
        for rid, rep in reps.items():
            n = rep.hit(held, keys, stops, tokens, mm_items)
            if gpu is not None and rep.host_bit and not (rep.sliding or rep.lookahead):
                gpu[rid] = n
                n = rep.host_extent(held, keys, n)
            if n:
                found[rid] = n
        return found

    def holds(self, replica: ReplicaId, key: BlockKey) -> bool:
        """`replica`'s GPU holds `key`."""
        rep = self._t.replicas.get(replica)
        return rep is not None and bool(self._t.held.get(key, 0) & rep.gpu_bits)

    # ---- introspection ---------------------------------------------------------------------

    def replica_blocks(self, replica: ReplicaId, host: bool = False) -> int:
        """Blocks `replica`'s GPU holds (its largest group's), or with `host` its host tier."""
        rep = self._t.replicas.get(replica)
        if rep is None:
            return 0
        if host:
            return g.blocks if (g := rep.groups.get(HOST_GROUP)) is not None else 0
        return max((g.blocks for i, g in rep.groups.items() if i != HOST_GROUP), default=0)

    def replica_host_blocks(self, replica: ReplicaId) -> int:
        """Blocks `replica`'s host tier holds."""
        return self.replica_blocks(replica, host=True)

    def replica_digest(self, replica: ReplicaId) -> str:
        """Order-independent digest of the gateway keys a replica's GPU holds (for comparing
        indexes, and with a worker's snapshot)."""
        rep = self._t.replicas.get(replica)
        h = hashlib.sha256()
        if rep is not None:
            held = self._t.held
            values = list(rep.engine.values())
            keys = {v if type(v) is bytes else v[1] for v in values}
            for key in sorted(k for k in keys if held.get(k, 0) & rep.gpu_bits):
                h.update(key)
        return h.hexdigest()

    def stats(self, copies: int, skipped_unknown_parent: int, skipped_bad_event: int) -> IndexStats:
        """The index's size and its estimated memory, with BlockIndex's counts."""
        engine_entries = sum(len(r.engine) for r in list(self._t.replicas.values()))
        n = len(self._t.held)
        return IndexStats(
            blocks=n,
            copies=copies,
            bytes=n * _BYTES_PER_KEY + engine_entries * _BYTES_PER_ENGINE_ENTRY,
            skipped_unknown_parent=skipped_unknown_parent,
            skipped_bad_event=skipped_bad_event,
        )

    def speculated(self) -> frozenset[BlockKey]:
        """The keys some replica is guessed to hold (speculative entries not yet expired or
        confirmed by an event): what a test or an operator may check is left behind."""
        return frozenset(self._t.spec.mask)

    def __len__(self) -> int:
        return len(self._t.held)
