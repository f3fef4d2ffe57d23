"""KV-event wire schema (vLLM's), with a decoder tolerant of both vLLM encodings.

kvgate publishes the current vLLM encoding: a batch is a map, each event a map tagged by
"type". Older vLLM releases (array_like structs) send a batch as ``[ts, events, dp_rank]`` and
each event as ``[tag, field0, field1, ...]``. Hashes may be ints (vLLM's default: the low 64
bits) or bytes. Unknown fields and unknown event types are ignored, never fatal.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import msgspec

# One engine block hash as it appears on the wire: bytes (kvgate, vLLM with bytes hashes) or int.
EngineHash = bytes | int

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    # One entry per block: the extra keys that went into that block's key.
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[EngineHash]
    medium: str | None = "GPU"


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_raw_decoder = msgspec.msgpack.Decoder()

# Positional field order of each event in vLLM's array_like encoding (after the tag).
_POSITIONAL = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def encode_batch(events: Iterable[KVEvent], dp_rank: int | None = None) -> bytes:
    return _encoder.encode(
        KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=dp_rank)
    )


def _as_extra(entry: Any) -> tuple[Any, ...] | None:
    """msgpack has no tuples: restore (identifier, offset) pairs and the per-block tuple."""
    if entry is None:
        return None
    return tuple(tuple(x) if isinstance(x, list) else x for x in entry)


def _fields(raw: Any) -> tuple[str, dict[str, Any]] | None:
    if isinstance(raw, dict):
        return raw.get("type"), raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        names = _POSITIONAL.get(raw[0], ())
        return raw[0], dict(zip(names, raw[1:], strict=False))
    return None


def _event(raw: Any) -> KVEvent | None:
    parsed = _fields(raw)
    if parsed is None:
        return None
    tag, f = parsed
    if tag == "BlockStored":
        extra = f.get("extra_keys")
        return BlockStored(
            block_hashes=list(f["block_hashes"]),
            parent_block_hash=f.get("parent_block_hash"),
            token_ids=list(f["token_ids"]),
            block_size=int(f["block_size"]),
            lora_id=f.get("lora_id"),
            medium=f.get("medium", "GPU"),
            lora_name=f.get("lora_name"),
            extra_keys=[_as_extra(e) for e in extra] if extra is not None else None,
        )
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=list(f["block_hashes"]), medium=f.get("medium", "GPU"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # an event type from a newer engine: skip it


class DecodeError(ValueError):
    """A payload that is not a KV-event batch in any known encoding."""


def decode_batch(payload: bytes) -> KVEventBatch:
    try:
        raw = _raw_decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise DecodeError(f"not msgpack: {e}") from e
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts", 0.0), raw.get("events", []), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise DecodeError(f"unexpected batch shape: {type(raw).__name__}")
    try:
        decoded = [e for e in (_event(r) for r in events) if e is not None]
    except (KeyError, TypeError, ValueError) as e:
        raise DecodeError(f"malformed event: {e}") from e
    return KVEventBatch(ts=float(ts), events=decoded, data_parallel_rank=rank)


def topic(instance_id: str, model: str) -> str:
    return f"kv@{instance_id}@{model}"


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_from_bytes(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)


# ---- replay (ROUTER <-> DEALER) -----------------------------------------------------------------
# A consumer sends [b"", start seq]. Since vLLM PR #45177 each reply is [b"", topic, seq, payload]
# after the ROUTER identity, ending with [b"", b"", -1, b""]; before it, [b"", seq, payload].


def replay_reply(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One replay reply (after the ROUTER identity) in the current vLLM layout."""
    return [b"", topic, seq_bytes(seq), payload]


REPLAY_END = [b"", b"", END_SEQ, b""]


def parse_replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one reply as a DEALER receives it, in either layout; None at the end."""
    if len(frames) == 4:
        raw_seq, payload = frames[2], frames[3]
    elif len(frames) == 3:
        raw_seq, payload = frames[1], frames[2]
    else:
        raise DecodeError(f"replay reply of {len(frames)} frames")
    if frames[0] != b"" or len(raw_seq) != 8:
        raise DecodeError("replay reply without its empty delimiter or 8-byte seq")
    seq = seq_from_bytes(raw_seq)
    return None if seq == -1 else (seq, payload)
