"""The documents a worker serves and the gateway reads: `/kvgate/info`, `/kv/snapshot`,
`/kvgate/assets`.

Both sides use these structs, so a field cannot be renamed on one side only. The gateway decodes
with `decode_*`, which checks every field's type and range and raises `DocumentError` naming the
document and the field; it never reads a dict with `.get()` and a fallback. Unknown fields are
ignored, so a newer worker can add some.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, TypeVar

import msgspec
import xxhash

from cachekey.events import MEDIUM_CPU, MEDIUM_GPU, BlockStored
from cachekey.keys import HashNamespace, MMMatchRule

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
# A BlockKey on the wire: lowercase or uppercase hex, whole bytes.
HexKey = Annotated[str, msgspec.Meta(pattern="^(?:[0-9a-fA-F]{2})+$")]
# An extra key on the wire: a string (LoRA name, cache salt) or [identifier, offset].
WireExtraKey = str | tuple[str, int]


class DocumentError(ValueError):
    """A worker document that does not decode into its struct (wrong JSON, field or type)."""


class FingerprintParts(msgspec.Struct, frozen=True, kw_only=True):
    """Digests of everything that determines block keys; two workers match iff these match."""

    tokenizer: str
    chat_template: str
    special_tokens: str
    image: str
    assets: str
    block_size: PositiveInt
    hash_seed: str
    namespace_model: str

    def digest(self) -> str:
        """xxh3-128 hex over the parts, as JSON with sorted keys (the info's `fingerprint`)."""
        blob = json.dumps(msgspec.structs.asdict(self), sort_keys=True).encode()
        return xxhash.xxh3_128_hexdigest(blob)


class KVEventsEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    """Where a worker publishes its KV events (ports on the worker's own host)."""

    enabled: bool
    port: Port | None = None
    replay_port: Port | None = None
    topic: str = ""
    # True: both sockets are CURVE servers keyed by the worker token (cachekey.worker_auth).
    curve: bool = False


class LoRAAdapters(msgspec.Struct, frozen=True, kw_only=True):
    """The LoRA adapters a worker serves: a request whose `model` names one of `adapters` is
    served there, at once when the adapter is `resident` (in one of its `max_loras` slots)."""

    max_loras: PositiveInt
    adapters: list[str]
    resident: list[str] = []
    max_lora_rank: PositiveInt | None = None


class RankInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One data-parallel rank of a worker that serves several behind one URL (as vLLM's
    `--data-parallel-size` does). Requests name it with `X-data-parallel-rank: <index in
    WorkerInfo.data_parallel_ranks>`; its snapshot is `/kv/snapshot?rank=<rank>`."""

    rank: Annotated[int, msgspec.Meta(ge=0)]  # the global rank, stamped into its event batches
    kv_events: KVEventsEndpoint
    num_blocks: PositiveInt | None = None
    host_num_blocks: PositiveInt | None = None  # its host KV tier's size (None: no tier)
    lora: LoRAAdapters | None = None  # its own slots (None: as WorkerInfo.lora)


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /kvgate/info`: how a worker keys blocks, who it is, and where its events are."""

    model: str
    block_size: PositiveInt
    hash_seed: str
    instance_id: str  # a new uuid4 hex on every start: a change means a restart
    kv_events: KVEventsEndpoint
    fingerprint: str | None = None  # FingerprintParts.digest(); None: unknown (plain vLLM)
    fingerprint_parts: FingerprintParts | None = None
    model_path: str | None = None
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0)] | None = None
    engine: str | None = None
    max_model_len: PositiveInt | None = None
    num_blocks: PositiveInt | None = None
    # Its host KV tier's size in blocks (None: no host tier, or not said, as plain vLLM): a
    # block evicted from the GPU moves there, and is lost only when that tier is full too.
    host_num_blocks: PositiveInt | None = None
    has_snapshot: bool = True  # False: no /kv/snapshot (plain vLLM), resync from empty
    # True: a request whose next prefix block another running request is computing waits for
    # it and hits it (kvgate's scheduler); False: it may compute it too (plain vLLM).
    defers_shared_prefill: bool = False
    lora: LoRAAdapters | None = None  # None: serves no LoRA adapter
    # What the engine reuses of a match that ends inside an image (cachekey.keys.usable_match).
    mm_match_rule: MMMatchRule = "clamp"
    # Several ranks behind this URL, in the order of their X-data-parallel-rank index; empty:
    # one engine, described by the fields above (data_parallel_rank, kv_events, lora).
    data_parallel_ranks: list[RankInfo] = []

    def namespace(self) -> HashNamespace:
        return HashNamespace(self.model, self.block_size, self.hash_seed)


class SnapshotBlock(msgspec.Struct, frozen=True):
    key: HexKey
    parent: HexKey | None  # None for block 0
    token_ids: list[int]
    extra_keys: tuple[WireExtraKey, ...] = ()


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /kv/snapshot`: every cached block, parents first, as of event batch `seq`: the GPU's
    in `blocks`, the host KV tier's (`medium: "CPU"`) in `host_blocks` (absent from a worker
    without one, or older than the field)."""

    instance_id: str
    seq: Annotated[int, msgspec.Meta(ge=0)] | None  # None: before the first batch, or no events
    block_size: PositiveInt
    blocks: list[SnapshotBlock]
    host_blocks: list[SnapshotBlock] = []

    def stored_events(self) -> Iterator[BlockStored]:
        """Each block as the BlockStored event that would have announced it, every parent
        before its children across both tiers (a GPU block's parent may be in the host tier
        only, and the other way round)."""
        for block, medium in _parents_first(self.blocks, self.host_blocks):
            yield BlockStored(
                block_hashes=[bytes.fromhex(block.key)],
                parent_block_hash=bytes.fromhex(block.parent) if block.parent else None,
                token_ids=block.token_ids,
                block_size=self.block_size,
                medium=medium,
                extra_keys=[block.extra_keys],
            )


def _parents_first(
    gpu: list[SnapshotBlock], host: list[SnapshotBlock]
) -> Iterator[tuple[SnapshotBlock, str]]:
    """Both tiers' blocks, each after its parent when the snapshot holds that parent (in either
    tier); each list is parents first already, so a block waits only for the other list's."""
    tiered = [(b, MEDIUM_GPU) for b in gpu] + [(b, MEDIUM_CPU) for b in host]
    present = {b.key.lower() for b, _ in tiered}
    done: set[str] = set()
    waiting: dict[str, list[tuple[SnapshotBlock, str]]] = {}
    for item in tiered:
        parent = item[0].parent.lower() if item[0].parent else None
        if parent is not None and parent in present and parent not in done:
            waiting.setdefault(parent, []).append(item)
            continue
        ready = [item]
        while ready:
            block, medium = ready.pop()
            yield block, medium
            key = block.key.lower()
            done.add(key)
            ready.extend(waiting.pop(key, ()))
    # A cycle (a malformed snapshot) leaves blocks waiting: they are not announced.


class AssetFiles(msgspec.Struct, frozen=True):
    """`GET /kvgate/assets`: the render assets by file name (base64 in JSON)."""

    files: dict[str, bytes]


_T = TypeVar("_T", WorkerInfo, Snapshot, AssetFiles)
ENDPOINTS = {WorkerInfo: "/kvgate/info", Snapshot: "/kv/snapshot", AssetFiles: "/kvgate/assets"}
_DECODERS = {t: msgspec.json.Decoder(t) for t in ENDPOINTS}
_encoder = msgspec.json.Encoder()


def encode_document(doc: WorkerInfo | Snapshot | AssetFiles) -> bytes:
    return _encoder.encode(doc)


def decode_document(data: bytes | str, kind: type[_T]) -> _T:
    """Decode one worker document; DocumentError says which one and what is wrong with it."""
    try:
        return _DECODERS[kind].decode(data)
    except msgspec.DecodeError as e:  # ValidationError included
        raise DocumentError(f"malformed {ENDPOINTS[kind]} document: {e}") from None
