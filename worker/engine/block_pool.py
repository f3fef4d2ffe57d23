"""BlockPool: the KV blocks, their ref counts, the key -> blocks map and the events it causes.

Two sequences prefilled in the same step both compute a block the other has not cached yet, so a
key can be held by several blocks. Each is a copy of its own, as in vLLM: each is stored and
evicted with its own event, and a child's parent stays cached while any copy lives. (Keeping the
second copy private instead orphans its children once the first copy is evicted: their
BlockStored names a parent nobody holds, and a consumer of the events must skip them.)
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from cachekey import BlockKey
from cachekey.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from worker.engine.free_queue import Block, FreeBlockQueue
from worker.engine.host_tier import HostTier


class BlockPool:
    """Owns every block. A block is in exactly one of: in use (ref_count > 0) or the free queue.

    A free block may still be cached (its key registered): it is evicted only when `take`
    needs it, and every eviction is reported as BlockRemoved. With a host tier, an evicted
    block's K/V is copied there first (its CPU events come before the GPU's BlockRemoved).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        publish_events: bool,
        host: HostTier | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # Key -> its copies, oldest first (one in the common case).
        self.cached: dict[BlockKey, list[Block]] = {}
        # Off with prefix caching: nothing is cached, so nothing is published.
        self.publish_events = publish_events
        self._events: list[KVEvent] = []
        self.host = host

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def lookup(self, key: BlockKey) -> Block | None:
        copies = self.cached.get(key)
        return copies[0] if copies else None

    def cached_blocks(self) -> list[Block]:
        """Every cached copy (a key held twice appears twice)."""
        return [b for copies in self.cached.values() for b in copies]

    def take(self, n: int) -> list[Block]:
        if n > self.num_free:
            raise RuntimeError(f"need {n} blocks, {self.num_free} free")
        taken = [self.free_queue.popleft() for _ in range(n)]
        evicted = [b for b in taken if b.key is not None]
        if evicted:
            if self.host is not None:  # copied out first: the tier's events go first too
                self._publish(self.host.offload(evicted))
            self._publish([BlockRemoved(block_hashes=[b.key for b in evicted])])
            for block in evicted:
                self._forget(block)
                block.clear_key()
        for block in taken:
            block.ref_count = 1
        return taken

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on cache hits, pulling free ones out of the LRU."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def refresh(self, blocks: Sequence[Block]) -> None:
        """Make free blocks the newest in the LRU, the first of `blocks` last of all."""
        queue = self.free_queue
        for block in reversed(blocks):
            if block.ref_count == 0:
                queue.remove(block)
                queue.append(block)

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference each; callers pass tail blocks first so they are evicted first."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {block.block_id} released twice")
            if block.ref_count == 0:
                self.free_queue.append(block)

    def untake(self, blocks: Sequence[Block]) -> None:
        """Give back blocks just taken and held by one owner, to the head (first of them first):
        the queue is as it was before `take`, up to which uncached block is which."""
        for block in reversed(blocks):
            assert block.ref_count == 1 and block.key is None, "untake of a shared or cached block"
            block.ref_count = 0
            self.free_queue.appendleft(block)

    def takes_no_cached(self, n: int) -> bool:
        """Would taking n blocks now find them free and evict none?"""
        if n > self.num_free:
            return False
        return all(block.key is None for block in islice(self.free_queue, n))

    def cache(self, blocks: Sequence[Block], stored: BlockStored | None) -> None:
        """Register already keyed blocks; publish one BlockStored for them."""
        for block in blocks:
            assert block.key is not None
            self.cached.setdefault(block.key, []).append(block)
        if stored is not None:
            self._publish([stored])

    def reset(self) -> bool:
        """Forget every cached block. Refused while any block is in use (as vLLM does)."""
        if self.num_free != self.num_blocks:
            return False
        for block in self.cached_blocks():
            block.clear_key()
        self.cached.clear()
        if self.host is not None:
            self.host.clear()
        self._publish([AllBlocksCleared()])
        return True

    def drain_events(self) -> list[KVEvent]:
        """The events since the last drain, in the order they happened."""
        events, self._events = self._events, []
        return events

    def _publish(self, events: list[KVEvent]) -> None:
        if self.publish_events:
            self._events += events

    def _forget(self, block: Block) -> None:
        assert block.key is not None
        copies = self.cached[block.key]
        copies.remove(block)  # O(copies): almost always one
        if not copies:
            del self.cached[block.key]
