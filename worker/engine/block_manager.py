"""BlockManager: maps sequences onto paged KV blocks and keeps the prefix cache honest.

A cache hit must match the request's key chain AND, block by block, the stored token ids,
extra keys (images, LoRA, salt) and parent: a key collision, forged or accidental, never
serves another request's K/V. A match that ends inside an image span is kept or rewound to the
span's start as the engine's `mm_match_rule` says (cachekey.usable_match): kept, the prefill starts
mid-image and takes the rest of the image's rows from the encoder cache or the vision tower
(mm_inputs). Either way a match leaves at least one prompt token to compute.

With a host tier (host_tier.py), a match that runs past the GPU's cached blocks continues
there under the same guard and rule: those blocks get fresh GPU blocks and their K/V is copied
back at admission, so they count as cached, not computed.
"""

from __future__ import annotations

from cachekey import BlockKey, MMMatchRule, usable_match
from cachekey.events import BlockStored, KVEvent
from worker.engine.block_pool import BlockPool
from worker.engine.free_queue import Block
from worker.engine.host_tier import HostBlock, HostTier
from worker.engine.outputs import CachedBlock
from worker.engine.sequence import Sequence

# A prefix hit: GPU blocks first, then the host tier's (which allocation copies back).
Hit = Block | HostBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def host_hits(hits: list[Hit]) -> list[HostBlock]:
    return [h for h in hits if isinstance(h, HostBlock)]


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        mm_match_rule: MMMatchRule,
        host: HostTier | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.mm_match_rule: MMMatchRule = mm_match_rule
        self.host = host
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching, host)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    # -- admission ---------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[Hit]:
        """The cached blocks usable as seq's prefix (after the equality guard and the rule),
        each from the GPU or, failing that, the host tier."""
        if not self.enable_prefix_caching:
            return []
        hits: list[Hit] = []
        parent = None
        for i, key in enumerate(seq.block_keys):
            block: Hit | None = self.pool.lookup(key)
            if block is None and self.host is not None:
                block = self.host.lookup(key)
            if block is None or not self._same_block(block, seq, i, parent):
                break
            hits.append(block)
            parent = key
        bs = self.block_size
        matched = usable_match(len(hits) * bs, seq.num_tokens, bs, seq.mm_items, self.mm_match_rule)
        return hits[: matched // bs]

    def _same_block(self, block: Hit, seq: Sequence, index: int, parent: object) -> bool:
        return (
            block.parent == parent
            and block.extra_keys == seq.block_extra[index]
            and block.token_ids == seq.block_tokens(index, self.block_size)
        )

    def refresh_chain(self, last: BlockKey) -> int:
        """Make the cached chain that ends at block `last` the newest in the LRU; returns its
        length (0 when a block of it is gone: the blocks after a gap are no prefix).

        The gateway names the last block it predicted a request to hit (the request's
        `X-kvgate-prefix` header) as soon as the request arrives. Rendering comes later, and
        only then does `refresh_cached_prefix` know the request's keys; a burst of work
        admitted meanwhile would otherwise evict that prefix from the LRU head first."""
        if not self.enable_prefix_caching:
            return 0
        chain: list[Hit] = []
        key: BlockKey | None = last
        longest = self.pool.num_blocks + (self.host.num_slots if self.host is not None else 0)
        while key is not None and len(chain) < longest:
            block: Hit | None = self.pool.lookup(key)
            if block is None and self.host is not None:
                block = self.host.lookup(key)  # a chain may run on in the host tier
            if block is None:
                return 0
            chain.append(block)
            key = block.parent
        chain.reverse()
        self._refresh(chain)
        return len(chain)

    def refresh_cached_prefix(self, seq: Sequence) -> None:
        """A queued request will hit its cached prefix: keep it from being evicted first by the
        work admitted ahead of it (the hit the gateway predicted when it routed the request)."""
        self._refresh(self.find_cached_prefix(seq))

    def _refresh(self, hits: list[Hit]) -> None:
        self.pool.refresh([b for b in hits if isinstance(b, Block)])
        if self.host is not None:
            self.host.refresh(host_hits(hits))

    def can_allocate(self, seq: Sequence, hits: list[Hit], num_new_tokens: int) -> bool:
        total_blocks = cdiv(len(hits) * self.block_size + num_new_tokens, self.block_size)
        # GPU hits sitting in the free queue stop being free once we reference them; a host
        # hit needs a fresh block like any computed one.
        gpu = [b for b in hits if isinstance(b, Block)]
        revived = sum(1 for b in gpu if b.ref_count == 0)
        return total_blocks - len(gpu) + revived <= self.pool.num_free

    def allocate(self, seq: Sequence, hits: list[Hit], num_new_tokens: int) -> None:
        assert not seq.block_table, "allocate on a sequence that holds blocks"
        self.pool.touch([b for b in hits if isinstance(b, Block)])
        loaded = self._load(host_hits(hits))
        seq.block_table = [
            h.block_id if isinstance(h, Block) else loaded.pop(0).block_id for h in hits
        ]
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        self._publish_loaded(hits, seq)
        self.append_slots(seq, num_new_tokens)

    def _load(self, entries: list[HostBlock]) -> list[Block]:
        """Fresh GPU blocks holding host-tier hits' K/V, keyed as their GPU copies were."""
        if not entries:
            return []
        assert self.host is not None
        self.host.lock(entries)  # the evictions `take` causes must not drop them meanwhile
        blocks = self.pool.take(len(entries))
        self.host.load(entries, [b.block_id for b in blocks])
        for block, entry in zip(blocks, entries, strict=True):
            block.key, block.parent = entry.key, entry.parent
            block.token_ids, block.extra_keys = entry.token_ids, entry.extra_keys
            block.lora_name, block.depth = entry.lora_name, entry.depth
        return blocks

    def _publish_loaded(self, hits: list[Hit], seq: Sequence) -> None:
        """Blocks copied back are cached on the GPU again: one BlockStored per run of them."""
        run: list[Block] = []
        for i, hit in enumerate([*hits, None]):
            if isinstance(hit, HostBlock):
                run.append(self.pool.blocks[seq.block_table[i]])
            elif run:
                self._publish(run, seq)
                run = []

    # -- growth ------------------------------------------------------------------------------

    def _blocks_missing(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(seq.block_table))

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._blocks_missing(seq, num_new_tokens) <= self.pool.num_free

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        missing = self._blocks_missing(seq, num_new_tokens)
        if missing:
            seq.block_table += [b.block_id for b in self.pool.take(missing)]

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks seq takes to grow by num_new_tokens."""
        return self._blocks_missing(seq, num_new_tokens)

    def free(self, seq: Sequence) -> None:
        blocks = [self.pool.blocks[i] for i in seq.block_table]
        keep = len(blocks)
        if seq.num_pending_tokens:
            # Launched ahead (--async-scheduling): a block taken for a step whose token the
            # request will not keep goes back to the head, as if never taken, since the
            # synchronous engine never took it. It lies past the last kept token (the last
            # sampled token is not computed: its K/V would be the next step's).
            keep = cdiv(min(seq.num_computed_tokens, seq.num_tokens - 1), self.block_size)
        if len(blocks) > keep:
            self.pool.untake(blocks[keep:])
        # Reverse order: a sequence's tail blocks are the least likely to be shared, so they
        # reach the LRU head first and are evicted before the prefix.
        self.pool.release(blocks[keep - 1 :: -1] if keep else [])
        seq.block_table = []
        seq.num_cached_blocks = 0

    # -- caching -----------------------------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks whose K/V is now complete; publish them as BlockStored."""
        if not self.enable_prefix_caching:
            return
        n_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_keys))
        run: list[Block] = []
        for i in range(seq.num_cached_blocks, n_full):
            block = self.pool.blocks[seq.block_table[i]]
            assert block.key is None, f"block {block.block_id} cached twice"
            # A key another sequence cached meanwhile makes this block a second copy of it
            # (see BlockPool): never a private block whose children would be orphans.
            block.key = seq.block_keys[i]
            block.parent = seq.block_keys[i - 1] if i else None
            block.token_ids = seq.block_tokens(i, self.block_size)
            block.extra_keys = seq.block_extra[i]
            block.lora_name = seq.lora_name
            block.depth = i
            run.append(block)
        if run:
            self._publish(run, seq)
        seq.num_cached_blocks = max(seq.num_cached_blocks, n_full)

    def _publish(self, run: list[Block], seq: Sequence) -> None:
        stored = BlockStored(
            block_hashes=[b.key for b in run],
            parent_block_hash=run[0].parent,
            token_ids=[t for b in run for t in b.token_ids],
            block_size=self.block_size,
            lora_name=seq.lora_name,
            extra_keys=[b.extra_keys or None for b in run],
        )
        self.pool.cache(run, stored)

    def reset(self) -> bool:
        return self.pool.reset()

    def drain_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

    def snapshot(self) -> list[CachedBlock]:
        """Every cached copy, parents first: a block's parent sits one level above it."""
        blocks = sorted(self.pool.cached_blocks(), key=lambda b: b.depth)
        return [
            CachedBlock(key=b.key, parent=b.parent, token_ids=b.token_ids, extra_keys=b.extra_keys)
            for b in blocks
            if b.key is not None
        ]

    def host_snapshot(self) -> list[CachedBlock]:
        """Every host-tier entry, parents first (empty without a tier)."""
        if self.host is None:
            return []
        entries = sorted(self.host.entries.values(), key=lambda e: e.depth)
        return [CachedBlock(e.key, e.parent, e.token_ids, e.extra_keys) for e in entries]
