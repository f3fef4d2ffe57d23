"""An O(1) intrusive doubly linked queue of free blocks (the LRU of cached-but-unused blocks).

Blocks are taken from the head; freed blocks go to the tail, so the head holds the block
unused for longest. A cache hit on a free block unlinks it from the middle in O(1), which a
deque cannot do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from cachekey import BlockKey
from cachekey.types import ExtraKey


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block is registered in the prefix cache.
    key: BlockKey | None = None
    parent: BlockKey | None = None
    token_ids: tuple[int, ...] = ()
    extra_keys: tuple[ExtraKey, ...] = ()
    lora_name: str | None = None  # what its BlockStored named (the host tier's event repeats it)
    # Position of the block in its sequence: orders a snapshot parents-first.
    depth: int = 0
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)

    def clear_key(self) -> None:
        self.key = None
        self.parent = None
        self.token_ids = ()
        self.extra_keys = ()
        self.lora_name = None
        self.depth = 0


class FreeBlockQueue:
    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(block_id=-1)  # sentinels never leave the queue
        self._tail = Block(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        assert last is not None
        self._link(last, block, self._tail)

    def appendleft(self, block: Block) -> None:
        first = self._head.next_free
        assert first is not None
        self._link(self._head, block, first)

    def _link(self, prev: Block, block: Block, nxt: Block) -> None:
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
        self._len += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1
