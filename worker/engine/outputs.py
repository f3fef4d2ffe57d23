"""What the engine hands out: per-step request outputs, stats, cached-block snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field

from cachekey import BlockKey
from cachekey.types import ExtraKey


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    # On a request's first token only (vLLM's intervals): seconds from arrival to its latest
    # admission, and from there to this token; None on later tokens.
    queue_s: float | None = None
    prefill_s: float | None = None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    block_size: int
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    encoder_cache_hits: int = 0
    images_processed: int = 0
    vision_tower_runs: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


@dataclass(slots=True)
class VisionCounters:
    encoder_cache_hits: int = 0
    images_processed: int = 0  # image spans fully merged into a forward pass
    vision_tower_runs: int = 0  # images encoded by the vision tower


@dataclass(frozen=True, slots=True)
class CachedBlock:
    key: BlockKey
    parent: BlockKey | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[ExtraKey, ...] = field(default=())
