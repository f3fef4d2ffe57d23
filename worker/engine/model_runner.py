"""ModelRunner: owns the model, the paged KV cache and the sampler; runs one step.

Pure-decode steps go through DecodeRunner (fixed buffers; CUDA graphs on CUDA), every other step
(prefill chunks, mixed batches, image rows) runs eagerly from `prepare_inputs`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

from cachekey.assets import ModelAssets
from worker.engine.config import CPU_KV_CACHE_BYTES, EngineConfig
from worker.engine.decode_attention import select_decode_kernel
from worker.engine.decode_runner import DecodeRunner
from worker.engine.encoder_cache import EncoderCache
from worker.engine.hidden_cache import HiddenStateCache, bytes_per_token
from worker.engine.hidden_reads import HiddenReads
from worker.engine.host_copy import HostKVCopier, block_bytes, block_planes
from worker.engine.input_batch import prepare_inputs
from worker.engine.memory import (
    cuda_budget,
    cuda_free_at_start,
    num_kv_blocks,
    step_peak_bytes,
)
from worker.engine.mm_inputs import VisionInputs
from worker.engine.outputs import VisionCounters
from worker.engine.paged_attention import PagedAttentionContext, PrefillSpan
from worker.engine.sampler import Sampler
from worker.engine.scheduler import ScheduledSeq
from worker.engine.sequence import Sequence
from worker.engine.staging import HostStager
from worker.engine.token_readback import Feed, SampledTokens, TokenReadback
from worker.models.image_processor import ImageProcessor
from worker.models.loader import load_model, read_config, resolve_device, resolve_dtype
from worker.models.lora import LoRAModel

logger = logging.getLogger("worker.engine")


class ModelRunner:
    def __init__(self, config: EngineConfig, assets: ModelAssets) -> None:
        model_dir = Path(config.model)
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available")
        self.device = resolve_device(config.device)
        self._free_at_start = 0
        sized_from_memory = config.num_blocks is None and config.kv_cache_memory_bytes is None
        if self.device.type == "cuda" and sized_from_memory:
            self._free_at_start = cuda_free_at_start(self.device, config.gpu_memory_utilization)
        self.dtype = resolve_dtype(config.dtype, read_config(model_dir), self.device)
        self.model = load_model(model_dir, self.device, self.dtype, config.elementwise_kernels)
        self.info = info = self.model.info
        self.vocab_size = info.vocab_size
        self.block_size = config.block_size
        # Full attention equals sliding-window attention as long as no sequence outgrows it.
        self.max_model_len = min(info.max_position_embeddings, info.sliding_window or 1 << 62)
        self.decode_kernel = select_decode_kernel(
            config.decode_attention, self.device, self.block_size, info.head_dim, info.num_kv_heads
        )
        self.decode_attention = self.decode_kernel.name
        self.stager = HostStager(self.device)
        self.sampler = Sampler(self.device)
        self.readback = TokenReadback(self.device, config.max_num_seqs)
        self.vision = self._vision_inputs(config, assets)
        self.lora: LoRAModel | None = None  # the LoRA manager's weights (LoRAWeights)
        if config.enable_lora:
            self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank)
        self.hidden_rows = len(config.hidden_state_layers) + 1 if config.hidden_state_cache else 0
        self.num_blocks = self._num_blocks(config)
        # One block more than the scheduler knows of: padded decode rows write there.
        self.kv_cache = self._allocate_kv(self.num_blocks + 1)
        # Before graph capture, so that the graphs write hidden states too.
        self.hidden_cache = self._hidden_cache(config.hidden_state_layers)
        self.hidden = HiddenReads(self.hidden_cache)
        self.offload: HostKVCopier | None = None  # the host KV tier's copies, when it is on
        self.use_cuda_graphs = (
            self.device.type == "cuda"
            and not config.enforce_eager
            and self.decode_attention == "triton"  # the reference gathers a per-step width
        )
        self.decoder = self._decode_runner(config)
        if self.use_cuda_graphs:
            with torch.inference_mode():
                self.decoder.capture()

    def _vision_inputs(self, config: EngineConfig, assets: ModelAssets) -> VisionInputs | None:
        info = self.info
        if not info.is_multimodal:
            return None
        if assets.image is None:
            raise ValueError("multimodal model without an image processor config")
        # Each step copies an image's rows by position (mm_inputs): the rendered span and the
        # tower's output must agree in length, checked once here rather than in every step.
        if assets.image.tokens_per_image != info.tokens_per_image:
            raise ValueError(
                f"the renderer gives an image {assets.image.tokens_per_image} placeholder "
                f"tokens but the vision tower returns {info.tokens_per_image} rows"
            )
        return VisionInputs(
            self.model,
            ImageProcessor.from_image_config(assets.image),
            EncoderCache(config.encoder_cache_bytes),
            self.device,
            self.dtype,
        )

    def host_copier(self, config: EngineConfig) -> tuple[int, HostKVCopier]:
        """The host KV tier's slots and copier: what a block owns (K/V, hidden states)."""
        hidden = self.hidden_cache.cache if self.hidden_cache is not None else None
        planes = block_planes(self.kv_cache, hidden, self.num_blocks + 1)
        slots = config.kv_offload_blocks or config.kv_offload_bytes // block_bytes(planes)
        self.offload = HostKVCopier(planes, slots, self.device)
        return slots, self.offload

    def _decode_runner(self, config: EngineConfig) -> DecodeRunner:
        max_len = min(self.max_model_len, self.num_blocks * self.block_size)
        if config.max_model_len is not None:
            max_len = min(max_len, config.max_model_len)
        return DecodeRunner(
            self.model,
            self.kv_cache,
            self.block_size,
            config.max_num_seqs,
            max_len,
            self.decode_kernel,
            self.stager,
            pad_block=self.num_blocks,
            use_graphs=self.use_cuda_graphs,
            lora=self.lora,
        )

    def _allocate_kv(self, num_blocks: int) -> Tensor:
        info = self.info
        shape = (info.num_layers, 2, num_blocks, self.block_size, info.num_kv_heads, info.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _hidden_cache(self, layers: tuple[int, ...]) -> HiddenStateCache | None:
        """The hidden-state cache in the KV cache's slots (padding block included), hooked in."""
        if not self.hidden_rows:
            return None
        cache = HiddenStateCache(
            self.num_blocks + 1,
            self.block_size,
            self.info.hidden_size,
            layers,
            self.dtype,
            self.device,
        )
        cache.attach(self.model)
        return cache

    def _num_blocks(self, config: EngineConfig) -> int:
        """Blocks the scheduler may use; a memory budget also pays for the spare padding block."""
        if config.num_blocks is not None:
            return config.num_blocks
        per_token = self.info.kv_bytes_per_token()
        per_token += bytes_per_token(self.info.hidden_size, self.hidden_rows, self.dtype)
        per_block = per_token * self.block_size
        budget = config.kv_cache_memory_bytes
        if budget is None and self.device.type == "cuda":
            peak = self.profile_peak(
                config.max_num_batched_tokens,
                config.max_num_seqs,
                config.max_model_len or self.max_model_len,
            )
            memory = cuda_budget(
                self.device, self._free_at_start, peak, config.gpu_memory_utilization
            )
            blocks = num_kv_blocks(memory, per_block) - 1
            logger.info("profiled step peak %.2f GiB; %d KV blocks", peak / 2**30, blocks)
        else:
            if budget is None:
                budget = CPU_KV_CACHE_BYTES
            blocks = budget // per_block - 1
        if blocks < 1:
            raise ValueError(f"the KV cache budget holds no block of {per_block} B")
        return blocks

    def profile_peak(self, num_tokens: int, num_seqs: int, max_len: int) -> int:
        """The sizing's activation peak: the larger of the largest fresh step and the largest
        chunk after the longest cached prefix. The second reads back its whole context, and
        attention's memory grows with it where no fused kernel serves the step (CUDA's math
        backend, float32 with grouped heads: measured on an H200, 2026-11-26)."""
        fresh = self.profile_max_step(num_tokens, num_seqs)
        if max_len <= num_tokens:
            return fresh
        return max(fresh, self.profile_max_step(num_tokens, num_seqs, context_len=max_len))

    @torch.inference_mode()
    def profile_max_step(self, num_tokens: int, num_seqs: int, context_len: int = 0) -> int:
        """Activation peak of the largest step: num_tokens prompt tokens in one chunk (images on
        as many of them as fit) ending at position `context_len` (default: a fresh prompt),
        then logits and sampling for num_seqs rows."""
        num_tokens = min(num_tokens, self.max_model_len)
        context_len = min(max(context_len, num_tokens), self.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        kv_cache = self._allocate_kv(num_blocks)
        slots = torch.arange(num_tokens, device=self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        # The prefix's slots wrap around the chunk's few blocks: the read-back of the whole
        # context is real, a cache of its size is not needed to profile it.
        prefix = None
        if context_len > num_tokens:
            prefix = torch.arange(context_len, device=self.device) % (num_blocks * self.block_size)

        def step() -> Tensor:
            images = None
            if self.vision is not None:
                per_image = self.info.tokens_per_image or num_tokens
                images = self.vision.encode_dummy(max(1, num_tokens // per_image))
            span = PrefillSpan(0, num_tokens, context_len, prefix)
            ctx = PagedAttentionContext(kv_cache, slots, [span], None, self.decode_kernel)
            if self.lora is not None:  # every token through a LoRA slot: its peak too
                self.lora.batch.prepare(torch.zeros_like(ids))
            hidden = self.model(ids, slots, ctx, self.model.embed_tokens(ids))
            if self.lora is not None:
                self.lora.batch.clear()
            del images
            rows = hidden[-min(num_seqs, num_tokens) :]
            logits = self.model.compute_logits(rows).float()
            return logits.softmax(-1).argmax(-1)

        return step_peak_bytes(step, self.device)

    @property
    def vision_counters(self) -> VisionCounters:
        return self.vision.counters if self.vision is not None else VisionCounters()

    def register(self, seq: Sequence) -> None:
        if seq.mm_items:
            if self.vision is None:
                raise ValueError("this model does not accept images")
            self.vision.register(seq)

    def release(self, request_id: str) -> None:
        self.sampler.forget(request_id)
        self.hidden.forget(request_id)
        if self.vision is not None:
            self.vision.release(request_id)

    def _is_decode_step(self, batch: list[ScheduledSeq]) -> bool:
        for item in batch:
            if item.num_new_tokens != 1 or item.seq.num_computed_tokens == 0:
                return False
        return self.vision is None or not self.vision.has_image_rows(batch)

    @property
    def overlaps(self) -> bool:
        """May a step run ahead of its read-back? Not while a request waits for a hidden state
        on the host, nor with the host tier's copies (whose waits are the step's own)."""
        return self.offload is None and not self.hidden.awaiting_last

    def can_launch(self, batch: list[ScheduledSeq]) -> bool:
        """A step for `launch`: any step without image rows (whose encoder work runs on the
        host's schedule) while steps may overlap."""
        return self.overlaps and (self.vision is None or not self.vision.has_image_rows(batch))

    @torch.inference_mode()
    def launch(
        self, batch: list[ScheduledSeq], feed: Feed | None
    ) -> tuple[list[int], SampledTokens | None]:
        """Queue a `can_launch` step and its read-back; nothing here waits for the device. The
        rows that sample, and their tokens (None if none does)."""
        hidden, sampling = self._forward(batch, feed)
        if not sampling:
            return sampling, None
        logits = self.model.compute_logits(hidden)
        requests = [(batch[i].seq.request_id, batch[i].seq.params) for i in sampling]
        return sampling, self.readback.start(self.sampler.sample_tensor(logits, requests))

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> list[int | None]:
        """Run one step; the sampled token of each sequence, None for a partial prefill."""
        if self.offload is not None:
            self.offload.wait()  # the host tier's copies this step's scheduling queued
        hidden, sampling = self._forward(batch, None)
        if self.hidden.awaiting_last:
            self.hidden.capture_last(batch, sampling, hidden)
        tokens: list[int | None] = [None] * len(batch)
        if not sampling:
            return tokens
        logits = self.model.compute_logits(hidden)
        requests = [(batch[i].seq.request_id, batch[i].seq.params) for i in sampling]
        sampled = self.sampler.sample(logits, requests)
        for index, token in zip(sampling, sampled, strict=True):
            tokens[index] = token
        return tokens

    def _forward(self, batch: list[ScheduledSeq], feed: Feed | None) -> tuple[Tensor, list[int]]:
        """The step's forward pass: the hidden states of the rows that sample, and those rows."""
        if self._is_decode_step(batch):
            hidden = self.decoder.run(batch, feed)
            sampling = [i for i, item in enumerate(batch) if item.completes_prompt]
            return (hidden[sampling] if len(sampling) < len(batch) else hidden), sampling
        inputs = prepare_inputs(
            batch, self.block_size, self.kv_cache, self.stager, self.decode_kernel, feed
        )
        embeds = None
        if self.vision is not None:
            embeds = self.vision.step_embeddings(batch, inputs.q_starts, inputs.input_ids)
        if self.lora is not None:
            self.lora.select([(item.lora_slot, item.num_new_tokens) for item in batch])
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.ctx, embeds)
        if self.lora is not None:
            self.lora.batch.clear()
        return hidden[inputs.logits_rows], inputs.sampling
