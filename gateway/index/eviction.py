"""What the index forgets in bulk: the oldest keys past its cap (`--index-max-blocks`; insertion
order is the LRU order: a store re-inserts its key), and everything one replica held. Both run
under the index's lock and return the copies they dropped."""

from __future__ import annotations

from itertools import islice

from cachekey.types import BlockKey
from gateway.index.lookup import IndexTables
from gateway.index.replica_blocks import ReplicaBlocks


def evict_oldest(t: IndexTables, extra: dict[tuple[BlockKey, int], int], max_blocks: int) -> int:
    """Drop the oldest keys past `max_blocks` (under the lock); returns the copies dropped.
    In batches: finding the oldest keys walks past the dict's deleted slots each time."""
    n = len(t.held) - max_blocks + max_blocks // 64
    by_bit = {g.bit: g for r in t.replicas.values() for g in r.groups.values()}
    copies = 0
    for key in list(islice(t.held, n)):
        mask = t.held.pop(key)
        while mask:
            bit = mask & -mask
            mask ^= bit
            copies += 1 + extra.pop((key, bit), 0)
            if bit in by_bit:
                by_bit[bit].blocks -= 1
    return copies


def forget_blocks(
    held: dict[BlockKey, int], extra: dict[tuple[BlockKey, int], int], rep: ReplicaBlocks
) -> int:
    """Clear `rep`'s slots (every tier) from every key it holds."""
    bits, copies = rep.all_bits, rep.blocks()
    for value in rep.engine.values():
        hkey = value if type(value) is bytes else value[1]
        mask = held.get(hkey, 0)
        if not mask & bits:
            continue
        for group in rep.groups.values():
            copies += extra.pop((hkey, group.bit), 0)
        if mask & ~bits:
            held[hkey] = mask & ~bits
        else:
            del held[hkey]
    return copies
