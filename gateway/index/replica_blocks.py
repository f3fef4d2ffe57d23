"""One replica's side of the BlockIndex: its slots (one per KV-cache group), engine-hash map, and
the rules that differ from plain prefix matching (sliding-window groups, lookahead keys)."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cachekey.events import MEDIUM_CPU, MEDIUM_GPU, BlockStored, EngineHash
from cachekey.keys import chain_keys, lookahead_key, request_lookahead_keys
from cachekey.types import BlockKey, MMItem

_SLIDING = ("sliding_window", "sliding_window_mla")
_MAMBA = "mamba"
# The group index of a replica's host-memory tier (vLLM's `medium: "CPU"`): a slot of its own,
# so one block may be held in both tiers and each tier's removals clear only its own bit.
HOST_GROUP = -1


def tier_group(medium: str | None, group_idx: int | None) -> int | None:
    """The group an event's blocks are held in: their own on the GPU; `HOST_GROUP` for the host
    tier (a plain model's group 0 only: a hybrid's other groups' hit needs more than their
    blocks). None: not applied (storage tiers, other groups' host copies)."""
    if medium in (None, MEDIUM_GPU):
        return group_idx or 0
    if medium == MEDIUM_CPU and not group_idx:
        return HOST_GROUP
    return None


def is_sparse(ev: BlockStored) -> bool:
    """A store of only some of the blocks its tokens cover: vLLM's sliding-window and Mamba
    groups keep just the blocks a later hit can end on, and name only those."""
    return len(ev.token_ids) > len(ev.block_hashes) * ev.block_size


@dataclass(slots=True)
class Group:
    """One KV-cache group of a replica, and the slot bit its holdings carry in the index."""

    bit: int
    kind: str | None = None  # vLLM's kv_cache_spec_kind; None: not reported (full attention)
    window: int | None = None  # kv_cache_spec_sliding_window, in tokens
    blocks: int = 0

    def tail_blocks(self, block_size: int) -> int | None:
        """For a group whose hit needs only the blocks just before its end (vLLM's
        sliding-window and Mamba managers), how many; None for a prefix group (full attention,
        and any kind not reported)."""
        if self.kind in _SLIDING and self.window:
            return -(-(self.window - 1) // block_size)
        if self.kind == _MAMBA:
            return 1  # the state at the end of the hit's last block
        return None


class ReplicaBlocks:
    """Engine hash -> gateway key (or (key, lookahead key)), and the replica's groups.

    `full_bits`, `full_bit_list`, `sliding`, `gpu_bits` and `host_bit` are derived and replaced
    whole when a group appears or changes, so that `BlockIndex.match` can read them from another
    thread. The host tier is the group `HOST_GROUP`: in `all_bits` (its blocks keep their engine
    hashes), not in `gpu_bits` (what the device holds: digests, `holds`).
    """

    __slots__ = (
        "_take_slot",
        "all_bits",
        "block_size",
        "engine",
        "full_bit_list",
        "full_bits",
        "gpu_bits",
        "groups",
        "home_bit",
        "host_bit",
        "host_mask",
        "id",
        "lookahead",
        "sliding",
    )

    def __init__(self, replica: str, take_slot: Callable[[], int]) -> None:
        self.id = replica
        self.engine: dict[EngineHash, BlockKey | tuple[BlockKey, BlockKey]] = {}
        self.groups: dict[int, Group] = {}
        self._take_slot = take_slot
        self.block_size = 0
        self.lookahead = 0
        self.all_bits = self.full_bits = self.gpu_bits = self.host_bit = self.host_mask = 0
        self.full_bit_list: tuple[int, ...] = ()
        self.sliding: tuple[tuple[int, int], ...] = ()
        self.home_bit = self.group(0, None, None).bit

    def group(self, idx: int | None, kind: str | None, window: int | None) -> Group:
        idx = idx or 0
        g = self.groups.get(idx)
        changed = g is None
        if g is None:
            g = self.groups[idx] = Group(1 << self._take_slot())
        if kind is not None and (kind, window) != (g.kind, g.window):
            g.kind, g.window = kind, window
            changed = True
        if changed:
            self._derive()
        return g

    def _derive(self) -> None:
        host = self.groups.get(HOST_GROUP)
        groups = [g for i, g in self.groups.items() if i != HOST_GROUP]
        bs = self.block_size or 1
        tails = [(g.bit, g.tail_blocks(bs)) for g in groups]
        full = tuple(bit for bit, need in tails if need is None)
        self.sliding = tuple((bit, need) for bit, need in tails if need is not None)
        self.full_bit_list = full or (groups[0].bit,)
        self.full_bits = sum(self.full_bit_list)
        self.gpu_bits = sum(g.bit for g in groups)
        self.host_bit = host.bit if host is not None else 0
        self.all_bits = self.gpu_bits | self.host_bit

    def slots(self) -> list[int]:
        return [g.bit.bit_length() - 1 for g in self.groups.values()]

    def blocks(self) -> int:
        return sum(g.blocks for g in self.groups.values())

    def set_host_rule(self, gpu_after_host: bool) -> None:
        """How a hit continues past the GPU's: block after block in either tier (kvgate's
        worker looks each block up on the GPU, then in its host tier), or with `gpu_after_host`
        False in the host tier only (vLLM's offloading connector looks up the host tier from
        the end of the GPU's hit)."""
        self.host_mask = self.host_bit | (self.full_bits if gpu_after_host else 0)

    def host_extent(self, held: dict[BlockKey, int], keys: Sequence[BlockKey], hit: int) -> int:
        """How far the prefix reaches past the GPU's `hit` through the host tier
        (`set_host_rule`). Not for hybrid or lookahead replicas (their hit needs more than the
        full-attention blocks; their host events are not applied)."""
        mask, n = self.host_mask, len(keys)
        while hit < n and held.get(keys[hit], 0) & mask:
            hit += 1
        return hit

    def hit(
        self,
        held: dict[BlockKey, int],
        keys: Sequence[BlockKey],
        stops: dict[int, int],
        tokens: Sequence[int] | None,
        mm_items: Sequence[MMItem],
    ) -> int:
        """Blocks of `keys` this replica would hit, given where the index's one pass over the
        keys stopped for each full-attention slot (`stops`: slot bit -> first miss)."""
        if self.lookahead:
            return self._lookahead_hit(held, keys, tokens, mm_items)
        hit = min(stops.get(b, len(keys)) for b in self.full_bit_list)
        if self.sliding and tokens and self.block_size:
            hit = min(hit, (len(tokens) - 1) // self.block_size)  # vLLM's cap first
        for bit, need in self.sliding:
            hit = window_hit(held, keys, hit, bit, need)
        return hit

    def _lookahead_hit(
        self,
        held: dict[BlockKey, int],
        keys: Sequence[BlockKey],
        tokens: Sequence[int] | None,
        mm_items: Sequence[MMItem],
    ) -> int:
        """Lookahead keys (EAGLE/MTP) need the request's tokens: without them, no hit."""
        if tokens is None or not keys or not self.block_size:
            return 0
        n, bits, size = 0, self.full_bits, self.block_size
        for lk in request_lookahead_keys(keys, tokens, size, self.lookahead, mm_items):
            if held.get(lk, 0) & bits != bits:
                break
            n += 1
        return n

    def sweep_engine(self, held: dict[BlockKey, int]) -> None:
        """Drop engine-map entries of keys the LRU cap evicted (removals drop their own)."""
        bits = self.all_bits
        self.engine = {
            h: v
            for h, v in self.engine.items()
            if held.get(v if type(v) is bytes else v[1], 0) & bits
        }


def window_hit(
    held: dict[BlockKey, int], keys: Sequence[BlockKey], limit: int, bit: int, need: int
) -> int:
    """vLLM's sliding-window hit within the first `limit` blocks: scanning from the right, the
    first run of `need` held blocks ends the hit; without one, the run from block 0 is the hit."""
    run = 0
    for i in range(limit - 1, -1, -1):
        if held.get(keys[i], 0) & bit:
            run += 1
            if run >= need:
                return i + need
        else:
            run = 0
    return run


def split_lookahead_extra(
    extra_keys: list | None, n: int, block_size: int
) -> tuple[list[tuple] | None, list[tuple]]:
    """A lookahead block's published extra keys cover the block and its lookahead tokens: split
    them into the block's own (as `block_extra_keys` makes them) and the mm items that start
    among the lookahead tokens (offset >= block_size)."""
    if extra_keys is None:
        return None, [()] * n
    plain, ahead = [], []
    for entry in extra_keys:
        entry = entry or ()
        late = tuple(x for x in entry if isinstance(x, tuple) and x[1] >= block_size)
        plain.append(tuple(x for x in entry if x not in late) or None)
        ahead.append(late)
    return plain, ahead


def stored_keys(ev: BlockStored, parent: BlockKey) -> tuple[list[BlockKey], list[BlockKey] | None]:
    """The gateway keys of a stored event's blocks, chained from `parent` (recomputed from its
    token ids and extra keys), and for a lookahead (EAGLE/MTP) event the keys the blocks are
    held as. Raises OverflowError/TypeError for token ids that are not uint32."""
    bs = ev.block_size
    packed = array("I", ev.token_ids).tobytes()
    if ev.lookahead_token_ids is None:
        return chain_keys(parent, packed, bs, ev.extra_keys), None
    extras, pairs = split_lookahead_extra(ev.extra_keys, len(ev.block_hashes), bs)
    keys = chain_keys(parent, packed, bs, extras)
    ahead = zip(keys, ev.lookahead_token_ids, pairs, strict=True)
    return keys, [lookahead_key(k, t, p) for k, t, p in ahead]
