"""Decode attention over the paged KV cache: the portable reference and the choice of kernel.

A decode kernel takes q [B, H, D], one layer's k/v cache [num_blocks, block_size, KV, D], block
tables [B, P] (only the first cdiv(context_len, block_size) entries of a row are read) and
context lengths [B], and returns [B, H, D].

- `reference`: gathers each row's first P pages and runs one masked SDPA call (native GQA). It runs
  anywhere; its cost grows with P, so callers pass tables cut to the longest row of the step.
- `triton` (CUDA): reads K/V through the block table inside the kernel and never builds the context.
  It is chosen on CUDA when triton imports and the shapes suit it; the CPU never imports it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from worker.engine.config import DECODE_BACKENDS

DecodeFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float], Tensor]


def paged_decode_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    batch, num_pages = block_tables.shape
    block_size = k_cache.shape[1]
    keys = k_cache[block_tables].flatten(1, 2).transpose(1, 2)  # [B, KV, P * block_size, D]
    values = v_cache[block_tables].flatten(1, 2).transpose(1, 2)
    positions = torch.arange(num_pages * block_size, device=q.device)
    mask = (positions[None, :] < context_lens[:, None]).view(batch, 1, 1, -1)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        keys,
        values,
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out.squeeze(2)


def select_decode_fn(
    backend: str, device: torch.device, block_size: int, head_dim: int, num_kv_heads: int
) -> tuple[str, DecodeFn]:
    """(name, kernel) for `backend` in DECODE_BACKENDS; "auto" is triton on CUDA when it can be."""
    if backend not in DECODE_BACKENDS:
        raise ValueError(f"decode attention must be one of {DECODE_BACKENDS}, got {backend!r}")
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return "reference", paged_decode_reference
    try:
        from worker.engine import triton_decode
    except ImportError as exc:
        if backend == "triton":
            raise ValueError(f"decode attention 'triton' needs triton: {exc}") from exc
        return "reference", paged_decode_reference
    if not triton_decode.supports(block_size, head_dim):
        if backend == "triton":
            raise ValueError(f"the triton decode kernel does not take block_size {block_size}")
        return "reference", paged_decode_reference
    num_sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 1
    )

    def triton_fn(
        q: Tensor, k: Tensor, v: Tensor, tables: Tensor, lens: Tensor, scale: float
    ) -> Tensor:
        splits = triton_decode.num_splits_for(q.shape[0], num_kv_heads, num_sms)
        return triton_decode.paged_decode_triton(q, k, v, tables, lens, scale, splits)

    return "triton", triton_fn
