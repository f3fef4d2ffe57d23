"""EncoderCache: image identifier -> projected vision embeddings, LRU bounded in bytes."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class EncoderCache:
    """Holds tensors (anything with `nbytes`) keyed by the image identifier.

    The identifier is the content hash (or the client's uuid) that also goes into the block
    keys, so an entry is valid for every request that shows the same image.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, identifier: str) -> bool:
        return identifier in self._entries

    def get(self, identifier: str) -> Any | None:
        entry = self._entries.get(identifier)
        if entry is not None:
            self._entries.move_to_end(identifier)
        return entry

    def put(self, identifier: str, embeddings: Any) -> None:
        size = int(embeddings.nbytes)
        if size > self.capacity_bytes:
            return  # would evict everything and still not fit
        old = self._entries.pop(identifier, None)
        if old is not None:
            self.num_bytes -= int(old.nbytes)
        while self.num_bytes + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= int(evicted.nbytes)
        self._entries[identifier] = embeddings
        self.num_bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0
