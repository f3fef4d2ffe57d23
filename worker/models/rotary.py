"""Rotary position embeddings (neox / rotate-half layout) with the common scaling rules.

Frequencies depend only on the config, and cos/sin only on each token's own position, so a token's
rotation is the same whether it is computed in a full prefill, a chunk or a decode step (the engine
relies on that for prefix caching and chunked prefill).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict with a "rope_type" key) from either config spelling.

    transformers < 5 writes `rope_theta` and `rope_scaling`; newer versions write `rope_parameters`
    (holding rope_theta and the scaling keys together).
    """
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    merged = {**params, **scaling}
    theta = float(merged.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    merged["rope_type"] = rope_type
    return theta, merged


def _default_inv_freq(base: float, dim: int) -> Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, dim: int, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[Tensor, float]:
    factor = float(scaling["factor"])
    original_max = int(scaling.get("original_max_position_embeddings") or max_position_embeddings)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _inv_freq(
    theta: float, rotary_dim: int, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[Tensor, float]:
    rope_type = scaling["rope_type"]
    attention_scaling = 1.0
    inv_freq = _default_inv_freq(theta, rotary_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq, attention_scaling = _yarn_inv_freq(
            theta, rotary_dim, scaling, max_position_embeddings
        )
    elif rope_type != "default":
        # "dynamic" rescales with the sequence length, which breaks the per-token rotation
        # that prefix caching relies on; refuse rather than compute something else silently.
        raise ValueError(f"unsupported rope scaling type {rope_type!r}")
    return inv_freq, attention_scaling


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q/k of shape [T, heads, head_dim] at the given per-token positions."""

    def __init__(self, inv_freq: Tensor, rotary_dim: int, attention_scaling: float = 1.0) -> None:
        super().__init__()
        # A plain attribute, not a buffer: models are built on the meta device and their state
        # comes only from checkpoints, which never hold the frequencies.
        self._inv_freq_cpu = inv_freq.float()
        self._inv_freq: Tensor | None = None
        self.rotary_dim = rotary_dim
        self.attention_scaling = attention_scaling
        # The fused kernel (worker.models.triton_ops, set by elementwise.use_kernels on CUDA);
        # None runs the torch code below, which is its reference.
        self.kernels: ModuleType | None = None

    @classmethod
    def from_config(
        cls, config: dict[str, Any], head_dim: int, max_position_embeddings: int
    ) -> RotaryEmbedding:
        theta, scaling = rope_settings(config)
        rotary_dim = int(head_dim * float(config.get("partial_rotary_factor", 1.0)))
        # Frequencies are config-derived constants: always compute them on the CPU, even while
        # the model is being built on the meta device.
        with torch.device("cpu"):
            inv_freq, attention_scaling = _inv_freq(
                theta, rotary_dim, scaling, max_position_embeddings
            )
        return cls(inv_freq, rotary_dim, attention_scaling)

    def _device_inv_freq(self, device: torch.device) -> Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = self._inv_freq_cpu.to(device)
        return self._inv_freq

    def _cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        inv_freq = self._device_inv_freq(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        if self.kernels is not None:
            inv_freq = self._device_inv_freq(positions.device)
            return self.kernels.rotary(positions, q, k, inv_freq, self.attention_scaling)
        cos, sin = self._cos_sin(positions, q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.rotary_dim == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
