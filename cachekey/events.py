"""KV-event wire schema (vLLM 0.33's), with a decoder that salvages every well-formed event.

vLLM 0.33 sends a batch as a positional msgpack array ``[ts, events, data_parallel_rank]`` and
each event as a map tagged by "type" (vLLM PR #42892); before that PR each event was a positional
array ``[tag, field0, field1, ...]``. kvgate's workers publish exactly vLLM 0.33's encoding;
kvgate batches from before it (a map with "ts", "events", "data_parallel_rank") still decode.
Hashes may be ints (vLLM's default: the low 64 bits) or bytes.

One malformed event, or field, never costs the batch: `decode_batch` returns the events it could
read and one reason per event it skipped (`bad_<field>`, `length_mismatch`, `unknown_event`, ...).
Unknown fields are ignored; a newer engine's event types are skipped and named.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from msgspec import Meta

# One engine block hash as it appears on the wire: bytes (kvgate, vLLM with bytes hashes) or an
# int (vLLM's low 64 bits, unsigned; SGLang's signed first 8 bytes; msgpack bounds both).
EngineHash = bytes | int
TokenId = Annotated[int, Meta(ge=0, lt=2**32)]
# KV-cache groups of one engine (full attention, sliding window, ...): real models have a few.
# A larger index is malformed, never a reason to open one more group per replica (each group
# must hold a block for the replica to be matched on it).
MAX_KV_CACHE_GROUPS = 16
GroupIdx = Annotated[int, Meta(ge=0, lt=MAX_KV_CACHE_GROUPS)]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # vLLM's offloading connector's host-memory tier (kvgate's worker's too)


# BlockStored and BlockRemoved send every field, defaults too: vLLM's own structs declare
# `lora_id`, `medium` and `lora_name` (BlockRemoved: `medium`) without a default, so vLLM's
# decoder refuses an event that leaves them out. (This decoder accepts either.)
class BlockStored(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[TokenId]
    block_size: Annotated[int, Meta(gt=0)]
    lora_id: int | None = None  # deprecated in vLLM; lora_name is what keys a block
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    # One entry per block: the extra keys that went into that block's hash, untagged as vLLM
    # publishes them: a LoRA name or cache salt (str), (mm identifier, offset) pairs, prompt
    # embedding digests (bytes). Checked by `_consistent` (msgspec cannot mix str and bytes).
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: GroupIdx | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: Annotated[int, Meta(gt=0)] | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    # EAGLE/MTP: the tokens after each block that its hash also covers, one list per block.
    lookahead_token_ids: list[list[TokenId]] | None = None


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[EngineHash]
    medium: str | None = MEDIUM_GPU
    group_idx: GroupIdx | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM 0.33's batch: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


@dataclass(slots=True)
class DecodedBatch:
    """The events that could be read, in order, and why each of the others was skipped."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
    errors: list[str] = field(default_factory=list)


class DecodeError(ValueError):
    """A payload that is not a KV-event batch in any known encoding."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


_encoder = msgspec.msgpack.Encoder()
_fast = msgspec.msgpack.Decoder(KVEventBatch)
_raw = msgspec.msgpack.Decoder()
_EVENT_TYPES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}
_FIELDS = {name: cls.__struct_fields__ for name, cls in _EVENT_TYPES.items()}
_FIELD_PATH = re.compile(r"\$\.(\w+)")


def encode_batch(events: Iterable[KVEvent], dp_rank: int | None = None) -> bytes:
    return _encoder.encode(
        KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=dp_rank)
    )


class _BatchHead(msgspec.Struct, array_like=True):
    ts: msgspec.Raw
    events: msgspec.Raw
    data_parallel_rank: int | None = None


_head = msgspec.msgpack.Decoder(_BatchHead)


def peek_rank(payload: bytes) -> int | None:
    """The data-parallel rank a batch names, without decoding its events (None: none, or not
    readable; `decode_batch` then says what is wrong)."""
    try:
        return _head.decode(payload).data_parallel_rank
    except msgspec.DecodeError:
        try:
            return decode_batch(payload).data_parallel_rank
        except DecodeError:
            return None


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one batch in any known encoding; raise DecodeError only if no event is readable."""
    try:
        batch = _fast.decode(payload)  # vLLM 0.33 and kvgate: every event well formed
    except msgspec.DecodeError:
        return _salvage(payload)
    events = [e for e in batch.events if _consistent(e) is None]
    if len(events) == len(batch.events):
        return DecodedBatch(batch.ts, events, batch.data_parallel_rank)
    return _salvage(payload)


def _salvage(payload: bytes) -> DecodedBatch:
    """The slow path: decode untyped, then each event on its own."""
    try:
        raw = _raw.decode(payload)
    except msgspec.DecodeError as e:
        raise DecodeError("not_msgpack", str(e)) from e
    if isinstance(raw, dict):  # kvgate's batches before vLLM 0.33's array form
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise DecodeError("bad_batch", f"not a batch: {type(raw).__name__}")
    ts, raw_events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    out = DecodedBatch(0.0, [])
    if isinstance(ts, int | float) and not isinstance(ts, bool):
        out.ts = float(ts)
    else:
        out.errors.append("bad_ts")  # the timestamp is informational: keep the events
    if rank is None or (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0):
        out.data_parallel_rank = rank
    else:
        out.errors.append("bad_data_parallel_rank")
    for item in raw_events:
        event, reason = _event(item)
        if event is not None:
            out.events.append(event)
        else:
            out.errors.append(reason)
    return out


def _event(raw: Any) -> tuple[KVEvent | None, str]:
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _FIELDS.get(tag, ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        return None, "not_an_event"
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(), ""
    cls = _EVENT_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        return None, "unknown_event"
    body = {k: v for k, v in fields.items() if k != "type"}
    try:
        event = msgspec.convert(body, cls)
    except msgspec.ValidationError as e:
        m = _FIELD_PATH.search(str(e))
        name = m.group(1) if m and m.group(1) in cls.__struct_fields__ else None
        if name is None and "missing required field" in str(e):
            return None, "missing_field"
        return None, f"bad_{name}" if name else "malformed_event"
    reason = _consistent(event)
    return (None, reason) if reason else (event, "")


def _consistent(ev: KVEvent) -> str | None:
    """What msgspec's types cannot say: the per-block lists agree with block_hashes."""
    if not isinstance(ev, BlockStored):
        return None
    n = len(ev.block_hashes)
    if not ev.token_ids and n:
        return "no_token_ids"  # vLLM's offloading tier sends empty metadata in some layouts
    # Whole blocks, at least one per hash. More blocks than hashes: a sparse group (vLLM's
    # sliding-window or Mamba group) publishes the tokens of every block it was handed but the
    # hashes of only those it keeps (`BlockIndex.store` resolves them).
    if len(ev.token_ids) % ev.block_size or len(ev.token_ids) < n * ev.block_size:
        return "length_mismatch"
    if ev.extra_keys is not None:
        if len(ev.extra_keys) != n:
            return "bad_extra_keys"
        extra = [None if e is None else _extra_entry(e) for e in ev.extra_keys]
        if any(e is False for e in extra):
            return "bad_extra_keys"
        ev.extra_keys = extra
    if ev.lookahead_token_ids is not None and len(ev.lookahead_token_ids) != n:
        return "bad_lookahead_token_ids"
    return None


def _extra_entry(entry: tuple) -> tuple | bool:
    """One block's extra keys with msgpack's lists turned back into (identifier, offset)
    tuples; False when an item is none of the shapes vLLM publishes."""
    out = []
    for item in entry:
        if isinstance(item, list | tuple):
            if len(item) != 2 or not isinstance(item[0], str) or type(item[1]) is not int:
                return False
            out.append((item[0], item[1]))
        elif isinstance(item, str | bytes | int):
            out.append(item)
        else:
            return False
    return tuple(out)


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
        raise DecodeError("bad_replay_reply", f"replay reply of {len(frames)} frames")
    if frames[0] != b"" or len(raw_seq) != 8:
        raise DecodeError("bad_replay_reply", "no empty delimiter or 8-byte seq")
    seq = seq_from_bytes(raw_seq)
    return None if seq == -1 else (seq, payload)
