"""The typed identities of the cache-key contract."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

# A 16-byte xxh3_128 digest identifying a full block and (through its parent) its whole prefix.
BlockKey = NewType("BlockKey", bytes)

# One element of a block's extra keys: a LoRA name or cache salt (str), or a multimodal item
# as (identifier, offset of the item relative to the block start). Offsets may be negative.
ExtraKey = str | tuple[str, int]


@dataclass(frozen=True, slots=True)
class MMItem:
    """A multimodal item inside a prompt: its placeholder span is [offset, offset + length)."""

    identifier: str
    modality: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class Prompt:
    """A rendered request: token ids with placeholders expanded, plus the multimodal spans."""

    token_ids: tuple[int, ...]
    mm_items: tuple[MMItem, ...] = ()
    # Decoded image bytes by identifier; the worker needs the pixels, the gateway only the keys.
    mm_data: dict[str, bytes] = field(default_factory=dict, compare=False, repr=False)
    # The content part each image came from (`messages[0].content[1]`, the first one for an image
    # sent twice), named in the errors that blame it (an image the worker cannot decode).
    mm_params: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.token_ids)
