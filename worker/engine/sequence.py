"""Sequence: one request's tokens, block table and progress through the engine."""

from __future__ import annotations

import time
from enum import Enum, auto

from cachekey import BlockKey, HashNamespace, Prompt, block_keys
from cachekey.types import ExtraKey
from worker.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A request inside the engine.

    `token_ids` is prompt + output. `num_computed_tokens` counts the tokens whose K/V is in
    the cache; the last sampled token is not computed until the next step. Keys of full blocks
    are kept in `block_keys`/`block_extra`: the prompt's are hashed once at creation, blocks
    filled by decoding are hashed incrementally (only the newly completed ones).
    """

    __slots__ = (
        "arrived_at",
        "block_extra",
        "block_keys",
        "block_table",
        "cache_salt",
        "finish_reason",
        "lora_name",
        "mm_data",
        "mm_items",
        "mm_params",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_host_cached_tokens",
        "num_pending_tokens",
        "num_prompt_tokens",
        "params",
        "request_id",
        "scheduled_at",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        namespace: HashNamespace,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.token_ids: list[int] = list(prompt.token_ids)
        self.num_prompt_tokens = len(prompt.token_ids)
        self.mm_items = prompt.mm_items
        self.mm_data = prompt.mm_data
        self.mm_params = prompt.mm_params
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.status = SequenceStatus.WAITING
        # Engine-clock times of arrival and of the latest admission (vLLM's QUEUED/SCHEDULED).
        self.arrived_at = time.monotonic()
        self.scheduled_at = self.arrived_at
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        # Sampled by a step still in flight (--async-scheduling), not yet in token_ids: the
        # next step's input, which that step reads from the device (overlap.py).
        self.num_pending_tokens = 0
        # Blocks at the head of block_table that are registered in the prefix cache.
        self.num_cached_blocks = 0
        # Prefix hit at first admission (what the user is told); None until admitted.
        self.num_cached_tokens: int | None = None
        self.num_host_cached_tokens = 0  # of those, the host KV tier's (copied back)
        self.block_extra: list[tuple[ExtraKey, ...]] = []
        self.block_keys: list[BlockKey] = block_keys(
            self.token_ids,
            namespace,
            self.mm_items,
            lora_name,
            cache_salt,
            extra_keys_out=self.block_extra,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int, namespace: HashNamespace) -> None:
        self.token_ids.append(token_id)
        bs = namespace.block_size
        if len(self.token_ids) % bs == 0:
            # A block just became full: key it (and only it) from its parent.
            start = len(self.block_keys)
            self.block_keys += block_keys(
                self.token_ids,
                namespace,
                self.mm_items,
                self.lora_name,
                self.cache_salt,
                start_block=start,
                parent=self.block_keys[-1] if start else None,
                extra_keys_out=self.block_extra,
            )

    def block_tokens(self, block_index: int, block_size: int) -> tuple[int, ...]:
        return tuple(self.token_ids[block_index * block_size : (block_index + 1) * block_size])
