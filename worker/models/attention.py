"""The attention interface between models and whoever owns the KV cache.

Models compute q/k/v for the T tokens of one forward call (all sequences flattened) and hand them
to an `AttentionContext`; the context decides where k/v live (the engine's paged cache, or nothing
at all for `DenseCausalContext`) and which earlier tokens each query may see. Models never know
about blocks or sequences.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class AttentionContext(Protocol):
    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] -> [T, heads, head_dim]."""
        ...


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, q_start: int = 0) -> Tensor:
    """Attention of the queries q (absolute positions q_start..) over keys k (positions 0..).

    q: [Tq, Hq, D]; k/v: [Tk, Hkv, D] with Tk == q_start + Tq. GQA heads are expanded here.
    """
    num_q, num_heads, _ = q.shape
    num_k, num_kv_heads, _ = k.shape
    if num_k != q_start + num_q:
        raise ValueError(f"{num_k} keys cannot serve {num_q} queries starting at {q_start}")
    if num_heads != num_kv_heads:
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if q_start == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        # Query i sits at absolute position q_start + i and sees keys 0..q_start + i.
        q_pos = torch.arange(q_start, q_start + num_q, device=q.device)[:, None]
        mask = torch.arange(num_k, device=q.device)[None, :] <= q_pos
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


class DenseCausalContext:
    """One sequence, no cache: every forward call holds the whole sequence from position 0."""

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        return causal_attention(q, k, v, scale)


class ContiguousCacheContext:
    """One sequence with a growing contiguous per-layer KV cache (reference for incremental decode).

    Each forward call continues the sequence: its tokens follow every token attended so far.
    """

    def __init__(self) -> None:
        self._keys: dict[int, Tensor] = {}
        self._values: dict[int, Tensor] = {}

    def num_cached(self, layer_idx: int = 0) -> int:
        cached = self._keys.get(layer_idx)
        return 0 if cached is None else cached.shape[0]

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        start = self.num_cached(layer_idx)
        if start:
            k = torch.cat([self._keys[layer_idx], k])
            v = torch.cat([self._values[layer_idx], v])
        self._keys[layer_idx], self._values[layer_idx] = k, v
        return causal_attention(q, k, v, scale, q_start=start)
