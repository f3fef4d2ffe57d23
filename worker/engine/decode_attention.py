"""Decode attention over the paged KV cache: the portable reference and the choice of kernel.

A decode kernel attends q [B, H, D] over one layer's k/v cache [num_blocks, block_size, KV, D]
through block tables [B, P] (only the first cdiv(context_len, block_size) entries of a row are
read) and context lengths [B], returning [B, H, D]. `plan` turns tables and lengths into what
every layer of the step reuses; `run` is called once per layer.

- `ReferenceDecode`: gathers each row's first P pages and runs one masked SDPA call (native GQA).
  It runs anywhere; its cost grows with P, so callers pass tables cut to the step's longest row.
  On the CPU, rows that share leading blocks (a tenant's cached system prompt) read that prefix
  once per group instead of once per row (cascade_decode).
- `TritonDecode` (CUDA): reads K/V through the block table inside the kernel and never builds the
  context. It is chosen on CUDA when triton imports and the shapes suit it; the CPU never
  imports it.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from worker.engine.cascade_decode import CascadePlan, plan_cascade, run_cascade
from worker.engine.config import DECODE_BACKENDS


class DecodeKernel(Protocol):
    name: str

    def plan(self, block_tables: Tensor, context_lens: Tensor, block_size: int) -> Any: ...

    def run(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: Any, scale: float
    ) -> Tensor: ...


class ReferenceDecode:
    name = "reference"

    def __init__(self) -> None:
        self._arange = torch.arange(0)

    def _positions(self, n: int, device: torch.device) -> Tensor:
        if self._arange.shape[0] < n or self._arange.device != device:
            self._arange = torch.arange(max(n, 2 * self._arange.shape[0]), device=device)
        return self._arange[:n]

    def plan(self, block_tables: Tensor, context_lens: Tensor, block_size: int) -> Any:
        """Flat cache slots of every row's pages [B, P * block_size] and the length mask."""
        batch, num_pages = block_tables.shape
        device = block_tables.device
        offsets = self._positions(block_size, device)
        positions = self._positions(num_pages * block_size, device)
        if device.type == "cpu" and batch > 1:
            cascade = plan_cascade(block_tables, context_lens, block_size, positions)
            if cascade is not None:
                return cascade
        slots = (block_tables[:, :, None] * block_size + offsets).flatten(1)
        mask = (positions[None, :] < context_lens[:, None]).view(batch, 1, 1, -1)
        return slots, mask

    def run(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: Any, scale: float) -> Tensor:
        if isinstance(plan, CascadePlan):
            return run_cascade(q, k_cache, v_cache, plan, scale)
        slots, mask = plan
        flat_k = k_cache.view(-1, *k_cache.shape[-2:])
        flat_v = v_cache.view(-1, *v_cache.shape[-2:])
        keys = flat_k[slots].transpose(1, 2)  # [B, KV, P * block_size, D]
        values = flat_v[slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys,
            values,
            attn_mask=mask,
            scale=scale,
            enable_gqa=q.shape[1] != keys.shape[1],
        )
        return out.squeeze(2)


class TritonDecode:
    name = "triton"

    def __init__(self, num_kv_heads: int, num_sms: int) -> None:
        from worker.engine import triton_decode

        self._kernels = triton_decode
        self.num_kv_heads = num_kv_heads
        self.num_sms = num_sms

    def plan(self, block_tables: Tensor, context_lens: Tensor, block_size: int) -> Any:
        return block_tables, context_lens

    def run(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: Any, scale: float) -> Tensor:
        tables, lens = plan
        splits = self._kernels.num_splits_for(q.shape[0], self.num_kv_heads, self.num_sms)
        return self._kernels.paged_decode_triton(q, k_cache, v_cache, tables, lens, scale, splits)


def select_decode_kernel(
    backend: str, device: torch.device, block_size: int, head_dim: int, num_kv_heads: int
) -> DecodeKernel:
    """The kernel for `backend` in DECODE_BACKENDS; "auto" is triton on CUDA when it can be."""
    if backend not in DECODE_BACKENDS:
        raise ValueError(f"decode attention must be one of {DECODE_BACKENDS}, got {backend!r}")
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return ReferenceDecode()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        # Refused here, at start-up, not at the first decode step's launch.
        raise ValueError("decode attention 'triton' needs CUDA (or TRITON_INTERPRET=1, tests)")
    try:
        from worker.engine import triton_decode
    except ImportError as exc:
        if backend == "triton":
            raise ValueError(f"decode attention 'triton' needs triton: {exc}") from exc
        return ReferenceDecode()
    if not triton_decode.supports(block_size, head_dim):
        if backend == "triton":
            raise ValueError(f"the triton decode kernel does not take block_size {block_size}")
        return ReferenceDecode()
    num_sms = 1
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return TritonDecode(num_kv_heads, num_sms)
