"""The one policy signature: rank the available replicas for a request, best first."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import xxhash

from cachekey.types import BlockKey
from gateway.fleet.replica import Replica
from gateway.names import ReplicaId


@dataclass(slots=True)
class RouteContext:
    candidates: list[Replica]  # available replicas, never empty
    keys: list[BlockKey]  # the request's full-block keys
    num_prompt_tokens: int
    block_size: int
    matched: dict[ReplicaId, int] = field(default_factory=dict)  # prefix blocks per replica
    headers: Mapping[str, str] = field(default_factory=dict)
    tie_seed: bytes = b""  # identical for identical requests on every gateway
    lora_name: str | None = None  # the LoRA adapter the request names (None: a base model)
    # Of `matched`, the blocks each replica's host tier serves (copied back, not recomputed);
    # only replicas with some.
    host: dict[ReplicaId, int] = field(default_factory=dict)
    # Blocks a replica's GPU cache holds now (the index's count; None: not known): with its
    # size, what a request's uncached prompt would evict there.
    cached_blocks: Callable[[ReplicaId], int] | None = None
    # Blocks a replica's host tier holds (None: not known, or routing as if no replica had a
    # host tier, `--ignore-host-tier`): with its size, whether what the GPU evicts is kept.
    host_blocks: Callable[[ReplicaId], int] | None = None


class Policy(Protocol):
    name: str

    def rank(self, ctx: RouteContext) -> list[Replica]: ...


def tie_order(seed: bytes, replica: Replica) -> int:
    """Rendezvous hash: a pseudo-random but reproducible order among equal-cost replicas."""
    return xxhash.xxh64_intdigest(seed + replica.id.encode())
