"""The requests in flight on a replica that share a prefix: cache_aware's busy term.

A hot prefix (one application's system prompt for all its users) should spread once its
holders are busy with it, while distinct tenants stay on the replicas that hold their own
prefixes. So a holder is charged only for its requests that share *this* request's prefix, not
for all its load (which moved many-tenant traffic off its holders, docs/benchmarks.md).

Each request in flight marks its replica with its block keys at depths 1, 2, 4, 8, ... blocks
(`marks`: a few dictionary entries a request, not one per block). For a request that a replica
holds `m` blocks of, the requests there sharing at least the largest power of two <= `m` of
its blocks are those whose mark at that depth equals its key there (`sharing`): at least half
of what the replica holds of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from cachekey.types import BlockKey


def marks(keys: Sequence[BlockKey]) -> tuple[BlockKey, ...]:
    """The request's keys at block depths 1, 2, 4, 8, ... (indices 0, 1, 3, 7, ...)."""
    out, depth = [], 1
    while depth <= len(keys):
        out.append(keys[depth - 1])
        depth *= 2
    return tuple(out)


def hold(counts: dict[BlockKey, int], held: tuple[BlockKey, ...]) -> None:
    """A request with marks `held` is now in flight on the replica counting `counts`."""
    for k in held:
        counts[k] = counts.get(k, 0) + 1


def unhold(counts: dict[BlockKey, int], held: tuple[BlockKey, ...]) -> None:
    """It ended (or left): its marks no longer count there."""
    for k in held:
        n = counts.get(k, 0) - 1
        if n > 0:
            counts[k] = n
        else:
            counts.pop(k, None)


def sharing(counts: dict[BlockKey, int], keys: Sequence[BlockKey], matched: int) -> int:
    """The requests in flight there that share at least half of the `matched` blocks the
    replica holds of a request with `keys` (0 when it holds none)."""
    if matched <= 0 or not keys:
        return 0
    depth = 1 << (min(matched, len(keys)).bit_length() - 1)
    return counts.get(keys[depth - 1], 0)
