"""Paged decode attention as a Triton kernel (CUDA; the CPU runs it only in Triton's interpreter).

One program per (sequence, KV head, split). It walks its share of the sequence's block table,
loading K/V tiles straight from the paged cache (no gathered copy of the context), and scores
every query head of its GQA group against each tile at once, so K/V are read once per KV head.
Splitting the context over several programs keeps the GPU busy when batch x KV heads is small
(flash-decoding); the partial results are merged by their log-sum-exp. Every size the kernel
depends on at launch is static per batch size, so a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Tokens scored per loop iteration; a multiple of the KV block size.
_TILE_TOKENS = 64


@triton.jit
def _load_tile(ptr, block, slot, kv_head, dims, mask, stride_b, stride_s, stride_h):
    """One KV head's keys or values at the tile's (block, slot) positions, [TILE, DIM_PAD]."""
    offsets = block[:, None] * stride_b + slot[:, None] * stride_s + kv_head * stride_h
    return tl.load(ptr + offsets + dims[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    lse_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + seq)
    num_pages = tl.cdiv(context_len, BLOCK_SIZE)
    pages_per_split = tl.cdiv(num_pages, NUM_SPLITS)
    page_lo = split * pages_per_split
    page_hi = tl.minimum(page_lo + pages_per_split, num_pages)

    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group
    head_ok = group < GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)

    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    tok = tl.arange(0, TILE)
    for first in range(page_lo * BLOCK_SIZE, page_hi * BLOCK_SIZE, TILE):
        pos = first + tok
        page = pos // BLOCK_SIZE
        valid = (pos < context_len) & (page < page_hi)
        block = tl.load(tables_ptr + seq * stride_tb + page, mask=valid, other=0)
        slot = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = _load_tile(k_ptr, block, slot, kv_head, dims, kv_mask, stride_kb, stride_ks, stride_kh)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = _load_tile(v_ptr, block, slot, kv_head, dims, kv_mask, stride_vb, stride_vs, stride_vh)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    nonempty = denom > 0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, denom, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, denom, 1.0)), float("-inf"))
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :],
        out,
        mask=head_ok[:, None] & dim_ok[None, :],
    )
    tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


def num_splits_for(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Enough programs to cover every SM about twice, at most 16 splits of one context."""
    programs = max(1, batch * num_kv_heads)
    return max(1, min(16, -(-2 * num_sms // programs)))


def paged_decode_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    num_splits: int = 1,
) -> Tensor:
    """q [B, H, D]; k/v_cache [num_blocks, block_size, KV, D] -> [B, H, D] in q's dtype."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    partial = torch.empty(
        (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    tile = max(_TILE_TOKENS, block_size)
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        partial,
        lse,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs 16 rows
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        TILE=tile,
        NUM_SPLITS=num_splits,
        # Half caches are upcast to float32 in the kernel: tf32 holds bf16/fp16 values exactly,
        # so tensor cores still do the products; float32 caches keep full precision.
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
    )
    if num_splits == 1:
        return partial[:, :, 0].to(q.dtype)
    weights = torch.softmax(lse, dim=-1)  # splits with no tokens have lse -inf: weight 0
    return (weights.unsqueeze(-1) * partial).sum(dim=2).to(q.dtype)


def supports(block_size: int, head_dim: int) -> bool:
    """Shapes the kernel handles: a power-of-two block size that divides the tile."""
    return block_size & (block_size - 1) == 0 and block_size <= 128 and head_dim <= 256
