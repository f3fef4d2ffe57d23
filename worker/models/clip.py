"""CLIP vision transformer (the LLaVA-1.5 vision tower)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from worker.models.attention import sdpa
from worker.models.layers import Embedding, MergedLinear, get_activation


@dataclass(slots=True)
class ClipVisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("vision hidden_size must be a multiple of num_attention_heads")
        if self.image_size % self.patch_size:
            raise ValueError("vision image_size must be a multiple of patch_size")
        get_activation(self.hidden_act)  # fail at load time, not at the first image

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ClipVisionConfig:
        if config.get("model_type", "clip_vision_model") not in ("clip_vision_model", "clip"):
            raise ValueError(f"unsupported vision tower model_type {config.get('model_type')!r}")
        if config.get("model_type") == "clip" and "vision_config" in config:
            config = config["vision_config"]
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in config.items() if k in names})


class ClipVisionEmbeddings(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.image_size = config.image_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            config.hidden_size,
            kernel_size=config.patch_size,
            stride=config.patch_size,
            bias=False,
        )
        self.position_embedding = Embedding(config.num_patches + 1, config.hidden_size)

    def forward(self, pixel_values: Tensor) -> Tensor:
        batch, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"image is {height}x{width}, the vision tower takes {self.image_size}")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.to(patches.dtype).expand(batch, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv_proj = MergedLinear(
            hidden, ("q_proj", "k_proj", "v_proj"), (hidden, hidden, hidden), bias=True
        )
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, hidden = x.shape
        qkv = self.qkv_proj(x).view(batch, seq, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, seq, head_dim]
        out = sdpa(q, k, v, self.head_dim**-0.5, causal=False)  # 4-D: flash-eligible on CUDA
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class ClipMLP(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = get_activation(config.hidden_act)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.self_attn = ClipAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ClipMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            ClipEncoderLayer(config) for _ in range(config.num_hidden_layers)
        )


class ClipVisionTransformer(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.embeddings = ClipVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = ClipEncoder(config)
        # Only the pooled output uses it (LLaVA never does); kept so checkpoints load strictly.
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: Tensor, num_layers: int | None = None) -> list[Tensor]:
        """Hidden states [embeddings (after pre_layrnorm), layer 1, ..., layer num_layers].

        `num_layers` stops early: a tower whose last layers feed nothing is not run to the end.
        """
        layers = self.encoder.layers if num_layers is None else self.encoder.layers[:num_layers]
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [hidden]
        for layer in layers:
            hidden = layer(hidden)
            states.append(hidden)
        return states


class ClipVisionModel(nn.Module):
    """Weight names follow transformers' CLIPVisionModel: `vision_model.*`."""

    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = ClipVisionTransformer(config)

    def forward(self, pixel_values: Tensor, num_layers: int | None = None) -> list[Tensor]:
        return self.vision_model(pixel_values, num_layers)
