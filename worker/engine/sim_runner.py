"""SimRunner: the `sim` engine's forward pass, a timing model that emits plausible tokens.

The scheduler, block manager, prefix cache and events are the real ones; only the model is
replaced: each step sleeps what the step would take, and each sequence gets tokens derived from
its prompt (and seed), so identical requests get identical answers and routing experiments are
reproducible. No torch.

A step's time: with `--sim-preset`, the step model fitted to a device's measured figures
(sim_presets.py: the batch's decode sequences and contexts, its prompt chunks, and the worker
server's own host cost per request it starts, scaled by `--sim-server-scale`, all of it or with
`--sim-server-model apart` only its per-uncached-token term); without one,
`prefill_s_per_token * prefill tokens + decode_s_per_step` whatever the batch. With a host KV
tier, a step also pays for the blocks copied back from it since the last step, at the preset's
host-to-device rate (free without a preset); the copies out to it overlap the steps on a GPU
(a side stream) and cost nothing here.
"""

from __future__ import annotations

import json
import struct
import time

import numpy as np
import xxhash

from cachekey.assets import ModelAssets
from cachekey.keys import pack_tokens
from worker.engine.config import SIM_DEFAULT_NUM_BLOCKS, EngineConfig
from worker.engine.hidden_reads import HiddenReads
from worker.engine.host_tier import CountingCopier
from worker.engine.lora_manager import NoWeights
from worker.engine.outputs import VisionCounters
from worker.engine.scheduler import ScheduledSeq
from worker.engine.sequence import Sequence
from worker.engine.sim_presets import StepCost, preset

# How many word-like vocabulary entries the sim draws its tokens from.
_VOCAB_SAMPLE = 2048


def _word_token_ids(assets: ModelAssets) -> list[int]:
    """Ids of tokens that read as plain words, so sim output looks like text."""
    vocab = assets.tokenizer.get_vocab()
    words = []
    for piece, token_id in vocab.items():
        core = piece.lstrip("Ġ▁")
        if (
            core.isascii()
            and core.isalpha()
            and core != piece
            and token_id not in assets.eos_token_ids
        ):
            words.append(token_id)
    if not words:  # tiny or unusual vocabularies: any non-EOS id will do
        words = [i for i in sorted(vocab.values()) if i not in assets.eos_token_ids]
    return sorted(words)[:_VOCAB_SAMPLE]


class SimRunner:
    def __init__(self, config: EngineConfig, assets: ModelAssets) -> None:
        self.num_blocks = config.num_blocks or SIM_DEFAULT_NUM_BLOCKS
        self.max_model_len = assets.max_model_len
        self.vocab_size = assets.tokenizer.get_vocab_size(with_added_tokens=True)
        self.prefill_s_per_token = config.sim_prefill_s_per_token
        self.decode_s_per_step = config.sim_decode_s_per_step
        self.time_scale = config.sim_time_scale
        self.step_cost: StepCost | None = None
        if config.sim_preset:
            self.step_cost = preset(config.sim_preset, config.sim_server_scale)
        # `apart`, `thread`: the API server charges the server's per-request and per-stream
        # terms (worker/server/app_state.py), so a step charges only the per-uncached-token one.
        self._apart = config.sim_server_model != "step"
        self._unstarted: set[str] = set()  # registered, not yet in a step (server cost due)
        self._words = _word_token_ids(assets)
        self._seeds: dict[str, int] = {}
        self._counters = VisionCounters()
        # Adapters are read and slotted as in the torch engine; only their weights are absent.
        self.lora = NoWeights() if config.enable_lora else None
        self.hidden = SimHiddenReads(config.hidden_state_cache, _text_config(assets))
        self.block_size = config.block_size
        self.offload: CountingCopier | None = None

    def host_copier(self, config: EngineConfig) -> tuple[int, CountingCopier]:
        """The host tier's slots and a copier that moves nothing but counts the loads."""
        per_block = self.block_size * (self.step_cost.kv_bytes_per_token if self.step_cost else 0)
        if config.kv_offload_blocks is not None:
            slots = config.kv_offload_blocks
        elif per_block:
            slots = config.kv_offload_bytes // per_block
        else:
            raise ValueError(
                "the sim engine sizes --kv-offload-bytes by a preset's bytes per token: "
                "give --sim-preset, or --kv-offload-blocks"
            )
        self.offload = CountingCopier(per_block, timed=self.step_cost is not None)
        return slots, self.offload

    @property
    def vision_counters(self) -> VisionCounters:
        return self._counters

    def register(self, seq: Sequence) -> None:
        digest = xxhash.xxh64(pack_tokens(seq.token_ids[: seq.num_prompt_tokens]))
        for item in seq.mm_items:
            digest.update(item.identifier.encode())
        if seq.params.seed is not None:
            digest.update(struct.pack("<q", seq.params.seed))
        self._seeds[seq.request_id] = digest.intdigest()
        self._unstarted.add(seq.request_id)

    def release(self, request_id: str) -> None:
        self._seeds.pop(request_id, None)
        self._unstarted.discard(request_id)
        self.hidden.forget(request_id)

    overlaps = False  # its steps have no device to overlap: --async-scheduling is a no-op

    def can_launch(self, batch: list[ScheduledSeq]) -> bool:
        return False

    def execute(self, batch: list[ScheduledSeq]) -> list[int | None]:
        prefill_tokens = 0
        tokens: list[int | None] = []
        for item in batch:
            seq = item.seq
            start = seq.num_computed_tokens
            if start < seq.num_prompt_tokens:
                prefill_tokens += item.num_new_tokens
            end = start + item.num_new_tokens
            self._counters.images_processed += sum(start < m.end <= end for m in seq.mm_items)
            tokens.append(self._token(seq) if item.completes_prompt else None)
        if self.step_cost is not None:
            delay = self.step_seconds(batch)
            if self.offload is not None:
                copy = self.step_cost.host_load(self.offload.take_loads() * self.block_size)
                self.offload.charge(copy * self.time_scale)  # as slept, below
                delay += copy
        else:
            delay = self.prefill_s_per_token * prefill_tokens + self.decode_s_per_step
        delay *= self.time_scale
        if delay > 0:
            time.sleep(delay)
        return tokens

    def step_seconds(self, batch: list[ScheduledSeq]) -> float:
        """The preset's time for `batch` (before its tokens are appended); marks the requests
        it starts as started."""
        c = self.step_cost
        assert c is not None
        decode, context, prompt, server = 0, 0, 0.0, 0.0
        for item in batch:
            seq = item.seq
            start = seq.num_computed_tokens
            if start < seq.num_prompt_tokens:
                prompt += c.prefill(item.num_new_tokens, start)
            else:
                decode += 1
                context += seq.num_tokens
            if seq.request_id in self._unstarted:
                self._unstarted.discard(seq.request_id)
                uncached = seq.num_prompt_tokens - start
                server += (
                    c.server_token * uncached if self._apart else c.server(len(batch), uncached)
                )
        base = c.eager_base if prompt else c.graph_base
        decode_part = decode * c.per_seq + c.ctx * context
        return base + decode_part + prompt + server

    def _token(self, seq: Sequence) -> int:
        mixed = xxhash.xxh64_intdigest(
            struct.pack("<QQ", self._seeds[seq.request_id], seq.num_tokens)
        )
        return self._words[mixed % len(self._words)]


def _text_config(assets: ModelAssets) -> dict:
    config = json.loads(assets.files.get("config.json", b"{}"))
    return config.get("text_config") or config


class SimHiddenReads(HiddenReads):
    """Hidden states of the right shape whose values derive from the tokens and the LoRA adapter
    (no model runs): the API, the prefix cache and the routing behave as with the torch engine."""

    def __init__(self, has_cache: bool, text_config: dict) -> None:
        super().__init__(None)
        self._has_cache = has_cache
        self.hidden_size = int(text_config.get("hidden_size", 64))
        self._num_layers = int(text_config.get("num_hidden_layers", 1))

    @property
    def has_cache(self) -> bool:
        return self._has_cache

    @property
    def row_layers(self) -> tuple[int, ...]:
        return (self._num_layers,) if self._has_cache else ()

    # Every pooling is made up in `read`: no last-token rows to capture or count.
    def want(self, request_id: str, pooling: str) -> None:
        self.check(pooling)
        self._wanted[request_id] = pooling

    def forget(self, request_id: str) -> None:
        self._wanted.pop(request_id, None)

    def read(self, seq: Sequence, pooling: str) -> np.ndarray:
        n = seq.num_prompt_tokens if pooling != "all" else seq.num_computed_tokens
        digest = xxhash.xxh64(pack_tokens(seq.token_ids[:n]))
        if seq.lora_name is not None:  # an adapter changes the hidden states, as with torch
            digest.update(b"\x00lora\x00" + seq.lora_name.encode())
        seed = digest.intdigest()
        rows = np.random.default_rng(seed).standard_normal((n, self.hidden_size), np.float32)
        if pooling == "all":
            return rows[None]
        return rows[-1] if pooling == "last" else rows.mean(axis=0)
