"""ModelRunner: owns the model, the paged KV cache and the sampler; runs one step."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from cachekey.assets import ModelAssets
from worker.engine.config import CPU_KV_CACHE_BYTES, CUDA_KV_CACHE_FRACTION, EngineConfig
from worker.engine.encoder_cache import EncoderCache
from worker.engine.input_batch import prepare_inputs
from worker.engine.mm_inputs import VisionInputs
from worker.engine.outputs import VisionCounters
from worker.engine.sampler import Sampler
from worker.engine.scheduler import ScheduledSeq
from worker.engine.sequence import Sequence
from worker.models.image_processor import ImageProcessor
from worker.models.loader import load_model, read_config, resolve_device, resolve_dtype


class ModelRunner:
    def __init__(self, config: EngineConfig, assets: ModelAssets) -> None:
        model_dir = Path(config.model)
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available")
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, read_config(model_dir), self.device)
        self.model = load_model(model_dir, self.device, self.dtype)
        self.info = self.model.info
        self.vocab_size = self.info.vocab_size
        self.block_size = config.block_size
        self.num_blocks = self._num_blocks(config)
        info = self.info
        self.kv_cache = torch.zeros(
            (
                info.num_layers,
                2,
                self.num_blocks,
                self.block_size,
                info.num_kv_heads,
                info.head_dim,
            ),
            dtype=self.dtype,
            device=self.device,
        )
        # Full attention equals sliding-window attention as long as no sequence outgrows it.
        self.max_model_len = min(info.max_position_embeddings, info.sliding_window or 1 << 62)
        self.sampler = Sampler(self.device)
        self.vision: VisionInputs | None = None
        if info.is_multimodal:
            if assets.image is None:
                raise ValueError("multimodal model without an image processor config")
            self.vision = VisionInputs(
                self.model,
                ImageProcessor.from_image_config(assets.image),
                EncoderCache(config.encoder_cache_bytes),
                self.device,
                self.dtype,
            )
        # Debug hook for tests: every logits row each request sampled from, in order.
        self.keep_logits = False
        self.logits: dict[str, list[Tensor]] = {}

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.num_blocks is not None:
            return config.num_blocks
        budget = config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * CUDA_KV_CACHE_FRACTION)
            else:
                budget = CPU_KV_CACHE_BYTES
        per_block = self.info.kv_bytes_per_token() * self.block_size
        if budget < per_block:
            raise ValueError(f"KV cache budget {budget} B is below one block ({per_block} B)")
        return budget // per_block

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
        if self.vision is not None:
            self.vision.release(request_id)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> list[int | None]:
        """Run one step; the sampled token of each sequence, None for a partial prefill."""
        inputs = prepare_inputs(batch, self.block_size, self.kv_cache, self.device)
        embeds = None
        if self.vision is not None:
            embeds = self.vision.step_embeddings(batch, inputs.q_starts, inputs.input_ids)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.ctx, embeds)
        tokens: list[int | None] = [None] * len(batch)
        if not inputs.sampling:
            return tokens
        logits = self.model.compute_logits(hidden[inputs.logits_rows])
        requests = [(batch[i].seq.request_id, batch[i].seq.params) for i in inputs.sampling]
        if self.keep_logits:
            for row, (request_id, _) in enumerate(requests):
                self.logits.setdefault(request_id, []).append(logits[row].float().cpu())
        sampled = self.sampler.sample(logits, requests)
        for index, token in zip(inputs.sampling, sampled, strict=True):
            tokens[index] = token
        return tokens
