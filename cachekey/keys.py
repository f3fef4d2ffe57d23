"""Block keys: pure functions from token ids and extra keys to chained 16-byte digests.

Key of block i = xxh3_128(parent || tokens as little-endian uint32 || encoded extra keys).
Block 0's parent is a root derived from a configured namespace, never from process randomness,
so every gateway and worker that share a namespace compute identical keys.
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import xxhash

from cachekey.types import BlockKey, ExtraKey, MMItem

_LITTLE = sys.byteorder == "little"
_TAG_STR = b"s"
_TAG_MM = b"m"
_TAG_INT = b"i"
_TAG_BYTES = b"b"
_NO_EXTRA = b"\x00"

# The namespace seed every worker and gateway uses unless told otherwise (`--hash-seed`).
DEFAULT_HASH_SEED = "kvgate-v1"


@dataclass(frozen=True, slots=True)
class HashNamespace:
    """What a root key is derived from. Two processes agree on keys iff they agree on this."""

    model: str
    block_size: int = 16
    seed: str = DEFAULT_HASH_SEED

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    def root(self) -> BlockKey:
        return root_key(self)


@functools.lru_cache(maxsize=256)  # one per namespace: every parentless event asks for it
def root_key(ns: HashNamespace) -> BlockKey:
    payload = b"kvgate-root\x00" + _encode_str(ns.model) + _encode_str(ns.seed)
    payload += struct.pack("<I", ns.block_size)
    return BlockKey(xxhash.xxh3_128_digest(payload))


def _encode_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def encode_extra_keys(extra_keys: Sequence[ExtraKey] | None) -> bytes:
    """Explicit, language-neutral encoding: a count, then one tagged, length-prefixed item each."""
    if not extra_keys:
        return _NO_EXTRA
    out = [b"\x01", struct.pack("<I", len(extra_keys))]
    for item in extra_keys:
        if isinstance(item, str):
            out += (_TAG_STR, _encode_str(item))
        elif isinstance(item, tuple | list) and len(item) == 2:
            ident, offset = item
            out += (_TAG_MM, _encode_str(str(ident)), struct.pack("<q", int(offset)))
        elif isinstance(item, bool | int):
            out += (_TAG_INT, struct.pack("<q", int(item)))
        elif isinstance(item, bytes):
            out += (_TAG_BYTES, struct.pack("<I", len(item)), item)
        else:
            raise TypeError(f"unsupported extra key {item!r}")
    return b"".join(out)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    buf = array("I", token_ids)
    if not _LITTLE:
        buf.byteswap()
    return buf.tobytes()


def hash_block(
    parent: BlockKey, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] | None = None
) -> BlockKey:
    """The key of one full block given its parent's key."""
    return BlockKey(
        xxhash.xxh3_128_digest(parent + pack_tokens(token_ids) + encode_extra_keys(extra_keys))
    )


def chain_keys(
    parent: BlockKey,
    packed_tokens: bytes,
    block_size: int,
    extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None,
) -> list[BlockKey]:
    """Keys of consecutive full blocks after `parent`: `hash_block` over each block in turn, with
    the tokens packed once (`pack_tokens`) for the whole run. The gateway's ingestion path."""
    step = 4 * block_size
    digest = xxhash.xxh3_128_digest
    keys: list[BlockKey] = []
    append = keys.append
    if extra_keys is None:  # the common case, kept tight: one digest per block
        for i in range(0, len(packed_tokens) - step + 1, step):
            parent = digest(parent + packed_tokens[i : i + step] + _NO_EXTRA)
            append(parent)
        return keys
    for i in range(len(packed_tokens) // step):
        extra = extra_keys[i]
        tail = encode_extra_keys(extra) if extra else _NO_EXTRA
        parent = digest(parent + packed_tokens[i * step : (i + 1) * step] + tail)
        append(parent)
    return keys


def lookahead_key(
    key: BlockKey, lookahead_tokens: Sequence[int], mm_pairs: Sequence[ExtraKey] = ()
) -> BlockKey:
    """A block whose engine hash also covers the next tokens (vLLM's EAGLE/MTP lookahead): the
    block's own key, those tokens and the mm items that start among them."""
    payload = b"kvgate-lookahead\x00" + key + pack_tokens(lookahead_tokens)
    return BlockKey(xxhash.xxh3_128_digest(payload + encode_extra_keys(mm_pairs)))


def request_lookahead_keys(
    keys: Sequence[BlockKey],
    token_ids: Sequence[int],
    block_size: int,
    lookahead: int,
    mm_items: Sequence[MMItem] = (),
) -> list[BlockKey]:
    """`lookahead_key` of each block of a request that has `lookahead` tokens after it."""
    out: list[BlockKey] = []
    for i, key in enumerate(keys):
        start, end = i * block_size, (i + 1) * block_size
        if end + lookahead > len(token_ids):
            break
        pairs = [
            (m.identifier, m.offset - start) for m in mm_items if end <= m.offset < end + lookahead
        ]
        out.append(lookahead_key(key, token_ids[end : end + lookahead], pairs))
    return out


def block_extra_keys(
    block_index: int,
    block_size: int,
    mm_items: Sequence[MMItem] = (),
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> tuple[ExtraKey, ...]:
    """Extra keys of one block, in vLLM's order: LoRA, then mm items, then the salt (block 0 only).

    Every mm item overlapping the block contributes (identifier, offset - block_start): two
    different images behind the same placeholder tokens never share a key, and the same image
    at a different position does not either.
    """
    start = block_index * block_size
    end = start + block_size
    keys: list[ExtraKey] = []
    if lora_name:
        keys.append(lora_name)
    for item in mm_items:
        if item.offset < end and item.end > start:
            keys.append((item.identifier, item.offset - start))
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys)


def block_keys(
    token_ids: Sequence[int],
    ns: HashNamespace,
    mm_items: Sequence[MMItem] = (),
    lora_name: str | None = None,
    cache_salt: str | None = None,
    *,
    start_block: int = 0,
    parent: BlockKey | None = None,
    extra_keys_out: list[tuple[ExtraKey, ...]] | None = None,
) -> list[BlockKey]:
    """Keys of the full blocks of `token_ids` from `start_block` on (the partial tail is unkeyed).

    `parent` must be the key of block `start_block - 1` when `start_block > 0`, which lets the
    engine key blocks incrementally as decoding fills them. When `extra_keys_out` is given, the
    extra keys of each keyed block are appended to it (the engine reports them in its events).
    """
    bs = ns.block_size
    if start_block > 0 and parent is None:
        raise ValueError("parent is required when start_block > 0")
    prev = parent if parent is not None else ns.root()
    n_full = len(token_ids) // bs
    keys: list[BlockKey] = []
    # mm items are few; a plain scan per block is cheaper than an interval tree here.
    for i in range(start_block, n_full):
        extra = block_extra_keys(i, bs, mm_items, lora_name, cache_salt)
        prev = hash_block(prev, token_ids[i * bs : (i + 1) * bs], extra)
        keys.append(prev)
        if extra_keys_out is not None:
            extra_keys_out.append(extra)
    return keys


def clamp_match(
    num_matched_tokens: int, num_tokens: int, block_size: int, mm_items: Sequence[MMItem] = ()
) -> int:
    """Clamp a prefix-cache match so it never ends inside a multimodal span.

    A match ending inside a span is rewound to the span start and rounded down to a block
    boundary, repeatedly (a rewind can land inside an earlier span). The match also never covers
    the whole prompt: at least one token is left to compute, so the last logits exist.
    """
    max_match = ((num_tokens - 1) // block_size) * block_size if num_tokens > 0 else 0
    n = min(num_matched_tokens, max_match)
    n -= n % block_size
    changed = True
    while changed and n > 0:
        changed = False
        for item in mm_items:
            if item.offset < n < item.end:
                n = (item.offset // block_size) * block_size
                changed = True
    return n


# How an engine treats a prefix-cache match that ends inside a multimodal span:
# - "clamp": rewind it to the span's start (LMDeploy #4618; kvgate's engine until it reuses partial
#   images);
# - "partial": keep it, the vision tower's output for the recomputed part coming from the encoder
#   cache (vLLM v1).
# Either way a match is whole blocks and leaves at least one prompt token to compute.
MMMatchRule = Literal["clamp", "partial"]


def usable_match(
    num_matched_tokens: int,
    num_tokens: int,
    block_size: int,
    mm_items: Sequence[MMItem],
    rule: MMMatchRule,
) -> int:
    """The tokens an engine with `rule` reuses of a `num_matched_tokens` prefix match."""
    return clamp_match(
        num_matched_tokens, num_tokens, block_size, mm_items if rule == "clamp" else ()
    )


_KEY_HEX_CHARS = 32  # xxh3_128


def parse_prefix_header(value: str) -> BlockKey | None:
    """The block key a prefix header names; None for anything but 16 bytes in hex (a hint is
    never an error)."""
    if len(value) != _KEY_HEX_CHARS:
        return None
    try:
        return BlockKey(bytes.fromhex(value))
    except ValueError:
        return None
