"""Small building blocks shared by the models: norms, activations, merged projections."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # Fused kernels (worker.models.triton_ops, set by elementwise.use_kernels on CUDA); None
        # runs the torch code below, which is their reference.
        self.kernels: ModuleType | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 and cast back before the weight, as the reference models do.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """(x + delta, its norm): a residual add and the norm after it, one pass when fused."""
        if self.kernels is not None:
            return self.kernels.add_rms_norm(x, delta, self.weight, self.eps)
        summed = x + delta
        return summed, self(summed)


def quick_gelu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(1.702 * x)


def gelu(x: Tensor) -> Tensor:
    return F.gelu(x)


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def gelu_new(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": gelu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_new": gelu_new,
    "quick_gelu": quick_gelu,
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[Tensor], Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unsupported activation {name!r}; known: {sorted(_ACTIVATIONS)}"
        ) from None


class GatedActivation(nn.Module):
    """act(gate) * up over the two halves of a merged gate_up projection (vLLM's SiluAndMul
    for silu)."""

    def __init__(self, act_name: str = "silu") -> None:
        super().__init__()
        self.act_name = act_name
        self.act = get_activation(act_name)
        # SwiGLU's fused kernel for silu (see RMSNorm.kernels); None: the torch code below.
        self.kernels: ModuleType | None = None

    def forward(self, gate_up: Tensor) -> Tensor:
        if self.kernels is not None:
            return self.kernels.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


class Embedding(nn.Embedding):
    """nn.Embedding that skips its random init on the meta device, where the loader builds
    models (loader.py) and init is meaningless: torch's meta `normal_` imports torch._dynamo,
    about a second of every worker's start on a CPU."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class MergedLinear(nn.Linear):
    """Several checkpoint projections stacked along the output dim (qkv, gate_up): one matmul.

    `shard_names[i]` is the checkpoint module name whose weight fills rows
    sum(shard_sizes[:i]) .. sum(shard_sizes[:i+1]); the weight loader uses both.
    """

    def __init__(
        self,
        in_features: int,
        shard_names: tuple[str, ...],
        shard_sizes: tuple[int, ...],
        bias: bool,
    ) -> None:
        if len(shard_names) != len(shard_sizes):
            raise ValueError("shard_names and shard_sizes differ in length")
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_names = shard_names
        self.shard_sizes = shard_sizes

    def shard_offset(self, shard_name: str) -> tuple[int, int]:
        idx = self.shard_names.index(shard_name)
        start = sum(self.shard_sizes[:idx])
        return start, self.shard_sizes[idx]
