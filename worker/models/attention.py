"""The attention interface between models and whoever owns the KV cache, and the SDPA calls.

Models compute q/k/v for the T tokens of one forward call (all sequences flattened) and hand them
to an `AttentionContext`; the context decides where k/v live (the engine's paged cache, or nothing
at all for `DenseCausalContext`) and which earlier tokens each query may see. Models never know
about blocks or sequences.

Every SDPA call here passes 4-D tensors with the KV heads unexpanded (`enable_gqa`), and a causal
mask aligned to the end of the keys as `causal_lower_right`, so CUDA can pick the flash or
memory-efficient kernels (O(T) memory) instead of the math kernel (O(T^2)).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

if torch.cuda.is_available():
    # Only CUDA's kernels take the lazy mask; torch.nn.attention.bias imports torch._dynamo, a
    # second of every CPU worker's start (and of each test that starts one) for nothing.
    from torch.nn.attention.bias import causal_lower_right

# On CUDA: flash first, then memory-efficient, never cuDNN. cuDNN's SDPA builds a new plan for
# every new shape (milliseconds of CPU each), and prompt lengths are all different.
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class AttentionContext(Protocol):
    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] -> [T, heads, head_dim]."""
        ...


def sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> Tensor:
    """q: [B, Hq, Tq, D]; k/v: [B, Hkv, Tk, D] with Tk >= Tq. Causal means lower-right aligned:
    query i sees keys 0..Tk - Tq + i (a chunk continuing a cached prefix)."""
    if q.device.type == "cuda":
        with sdpa_kernel(_CUDA_BACKENDS):
            return _sdpa(q, k, v, scale, causal)
    return _sdpa(q, k, v, scale, causal)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> Tensor:
    num_q, num_k = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if not causal:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    if num_q == num_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if q.device.type == "cuda":  # flash / memory-efficient kernels with the lower-right variant
        mask = causal_lower_right(num_q, num_k)
    else:  # what causal_lower_right materialises off CUDA anyway
        offset = num_k - num_q
        mask = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device).tril(offset)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


# The CPU flash kernel, which also returns each query's log-sum-exp (SDPA's public call does not).
FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def chunk_after_prefix(
    q: Tensor, k: Tensor, v: Tensor, prefix_k: Tensor, prefix_v: Tensor, scale: float
) -> Tensor:
    """Attention of a chunk's queries over a cached prefix and, causally, over the chunk itself.

    q: [T, Hq, D]; k/v: [T, Hkv, D] the chunk's own keys; prefix_k/v: [P, Hkv, D], every one
    visible to every query. Equal to `causal_attention` over the concatenated keys. On the CPU it
    runs as two unmasked calls merged by their log-sum-exp: the prefix with the query heads of
    each KV head stacked (one call, no mask: the mask is what made the one-call form slow, its
    T x (P + T) booleans built, converted and read per layer), the chunk square-causal.
    """
    if q.device.type != "cpu" or FLASH_CPU is None:
        keys, values = torch.cat([prefix_k, k]), torch.cat([prefix_v, v])
        return causal_attention(q, keys, values, scale, q_start=prefix_k.shape[0])
    num_q, heads, dim = q.shape
    kv = k.shape[1]
    stacked = q.reshape(num_q, kv, heads // kv, dim).permute(1, 2, 0, 3).reshape(1, kv, -1, dim)
    p_out, p_lse = FLASH_CPU(
        stacked, *(x.transpose(0, 1)[None] for x in (prefix_k, prefix_v)), scale=scale
    )
    p_out, p_lse = p_out.reshape(heads, num_q, dim), p_lse.reshape(heads, num_q)
    own_k, own_v = (x.transpose(0, 1).repeat_interleave(heads // kv, 0)[None] for x in (k, v))
    c_out, c_lse = FLASH_CPU(q.transpose(0, 1)[None], own_k, own_v, is_causal=True, scale=scale)
    lse = torch.logaddexp(p_lse, c_lse[0])
    out = p_out * (p_lse - lse).exp().unsqueeze(-1) + c_out[0] * (c_lse[0] - lse).exp().unsqueeze(
        -1
    )
    return out.transpose(0, 1).to(q.dtype)  # the log-sum-exps, and so the merge, are float32


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, q_start: int = 0) -> Tensor:
    """Attention of the queries q (absolute positions q_start..) over keys k (positions 0..).

    q: [Tq, Hq, D]; k/v: [Tk, Hkv, D] with Tk == q_start + Tq.
    """
    num_q = q.shape[0]
    num_k = k.shape[0]
    if num_k != q_start + num_q:
        raise ValueError(f"{num_k} keys cannot serve {num_q} queries starting at {q_start}")
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return sdpa(qh, kh, vh, scale, causal=True)[0].transpose(0, 1)


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
