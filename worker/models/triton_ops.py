"""Fused elementwise kernels for the Llama decoder in Triton: RMSNorm (with the residual add),
rotary embedding and SwiGLU. CUDA only; the CPU runs them only in Triton's interpreter (tests).

Each replaces a chain of small torch ops (RMSNorm alone is six kernels, rotary recomputes cos/sin
in every layer) with one pass over memory. They compute in float32 and round once to the
input's dtype; the torch code in layers.py and rotary.py is the reference they are tested
against (equal in float32 up to summation order; half precision within a rounding or two).
Every program handles one token row (SwiGLU: a slice of one), so the number of tokens is only
the grid: no recompilation per step size, and a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

# Columns of the intermediate size per SwiGLU program.
_SILU_BLOCK = 1024
_TWO_PI = tl.constexpr(2 * math.pi)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_delta,
    stride_out,
    stride_sum,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        # The residual sum is rounded to the stream's dtype before the norm, as in torch.
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    # Cast back before the weight, as the reference models do (layers.RMSNorm).
    normed = (x32 * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask
    )


@triton.jit
def _rotate_heads(
    src,
    dst,
    token,
    stride_t,
    stride_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,
):
    """One token's heads, neox layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); the dims
    past the rotary dims (partial rotary) are copied."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    src_row = src + token * stride_t + heads * stride_h
    dst_row = dst + token * (NUM_HEADS * HEAD_DIM) + heads * HEAD_DIM
    x1 = tl.load(src_row + dims, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_row + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    out_ty = dst.dtype.element_ty
    tl.store(dst_row + dims, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(dst_row + HALF + dims, (x2 * cos + x1 * sin).to(out_ty), mask=mask)
    if TAIL_PAD > 0:
        tail = tl.arange(0, TAIL_PAD)[None, :]
        tail_mask = (heads < NUM_HEADS) & (tail < HEAD_DIM - 2 * HALF)
        rest = tl.load(src_row + 2 * HALF + tail, mask=tail_mask, other=0.0)
        tl.store(dst_row + 2 * HALF + tail, rest, mask=tail_mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    inv_freq_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    scaling,
    Q_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    dims = tl.arange(0, HALF_PAD)
    position = tl.load(positions_ptr + token).to(tl.float32)
    # The angle in float32, as the reference computes it, then reduced to [-pi, pi] in float64:
    # positions reach 1e5 radians, where sin/cos take libdevice's slow range reduction, and a
    # fast approximation (no reduction at all) would be far off.
    freqs = (position * tl.load(inv_freq_ptr + dims, mask=dims < HALF, other=0.0)).to(tl.float64)
    two_pi = tl.full([HALF_PAD], _TWO_PI, tl.float64)  # a float64 constant, not float32's 2 pi
    angles = (freqs - tl.floor(freqs / two_pi + 0.5) * two_pi).to(tl.float32)
    # cos/sin once per token for every head of q and k (the reference builds them per layer).
    cos = (tl.cos(angles) * scaling)[None, :]
    sin = (tl.sin(angles) * scaling)[None, :]
    _rotate_heads(
        q_ptr, q_out_ptr, token, stride_qt, stride_qh, cos, sin,
        Q_HEADS, Q_HEADS_PAD, HEAD_DIM, HALF, HALF_PAD, TAIL_PAD,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, token, stride_kt, stride_kh, cos, sin,
        K_HEADS, K_HEADS_PAD, HEAD_DIM, HALF, HALF_PAD, TAIL_PAD,
    )  # fmt: skip


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, N: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: Tensor) -> Tensor:
    """x as [rows, last dim] with unit stride along the last dim (a view when it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    hidden = x.shape[-1]
    rows = _rows(x)
    deltas = _rows(delta) if delta is not None else rows
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if delta is not None else out
    if rows.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, deltas, weight, out, summed,
            rows.stride(0), deltas.stride(0), out.stride(0), summed.stride(0), eps,
            N=hidden, BLOCK=block, ADD=delta is not None, num_warps=min(max(block // 256, 1), 8),
        )  # fmt: skip
    return summed.view(x.shape), out.view(x.shape)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [..., hidden] in x's dtype."""
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, RMSNorm(x + delta)) in one pass: the residual add and the next layer norm."""
    return _norm(x, delta, weight, eps)


def rotary(
    positions: Tensor, q: Tensor, k: Tensor, inv_freq: Tensor, scaling: float
) -> tuple[Tensor, Tensor]:
    """q [T, heads, D], k [T, kv_heads, D] (strided views of the qkv projection are fine) rotated
    at positions [T] by inv_freq [rotary_dim / 2] (float32, on q's device); new tensors."""
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    positions = positions.contiguous()  # a no-op for the engine's, which are
    q_out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, k_heads, head_dim), dtype=k.dtype, device=k.device)
    if not tokens:
        return q_out, k_out
    half = inv_freq.shape[0]
    tail = head_dim - 2 * half
    _rotary_kernel[(tokens,)](
        positions, inv_freq, q, k, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), scaling,
        Q_HEADS=q_heads, Q_HEADS_PAD=triton.next_power_of_2(q_heads),
        K_HEADS=k_heads, K_HEADS_PAD=triton.next_power_of_2(k_heads),
        HEAD_DIM=head_dim, HALF=half, HALF_PAD=triton.next_power_of_2(half),
        TAIL_PAD=triton.next_power_of_2(tail) if tail else 0,
    )  # fmt: skip
    return q_out, k_out


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up over the two halves of gate_up [..., 2 * I] -> [..., I]."""
    inter = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    out = torch.empty((rows.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(inter, _SILU_BLOCK))
        _silu_and_mul_kernel[grid](
            rows, out, rows.stride(0), out.stride(0), N=inter, BLOCK=_SILU_BLOCK, num_warps=4
        )
    return out.view(*gate_up.shape[:-1], inter)
