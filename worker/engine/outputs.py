"""What the engine hands out: per-step request outputs, stats, cached-block snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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
    # Of num_cached_tokens, those copied back from the host KV tier; None: the engine has none.
    num_host_cached_tokens: int | None = None
    # On a request's first token only (vLLM's intervals): seconds from arrival to its latest
    # admission, and from there to this token; None on later tokens.
    queue_s: float | None = None
    prefill_s: float | None = None
    # What the request asked for with `hidden_states`, on its final output only.
    hidden_states: np.ndarray | None = None


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
    hidden_cache_bytes: int = 0
    hidden_queries_tokens: int = 0  # prompt tokens of requests that wanted hidden states
    hidden_hits_tokens: int = 0  # of those, served from the prefix cache
    prefix_hint_blocks: int = 0  # cached blocks the gateway's x-kvgate-prefix hints refreshed
    # The host KV tier (all 0 without one): prompt tokens found there, the queries it saw,
    # bytes copied out to it and back, its blocks and their usage.
    host_hits_tokens: int = 0
    host_queries_tokens: int = 0
    host_saved_bytes: int = 0
    host_loaded_bytes: int = 0
    # The host -> GPU copies' time (the sim's: charged); None: not timed (sim without a preset).
    host_load_seconds: float | None = None
    host_num_blocks: int = 0
    host_cache_usage: float = 0.0
    lora: LoRAStats | None = None  # None: LoRA is not enabled


@dataclass(frozen=True, slots=True)
class LoRAStats:
    max_loras: int
    max_lora_rank: int
    adapters: tuple[tuple[str, str], ...]  # registered (name, path), in load order
    resident: tuple[str, ...]  # in a device slot now
    running: tuple[str, ...]  # with a running request
    waiting: tuple[str, ...]  # with a waiting request
    loads: int  # adapters copied into a slot so far


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
