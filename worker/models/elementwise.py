"""Which code runs the decoder's elementwise work: the torch reference, or fused Triton kernels.

RMSNorm (with the residual add before the MLP's norm), rotary embedding and SwiGLU are each a
chain of small torch ops; `triton_ops` fuses each into one kernel. The torch code stays in the
modules (layers.RMSNorm, layers.GatedActivation, rotary.RotaryEmbedding) as the reference the
kernels are tested against, and as the path for every device without them. `use_kernels` points
a loaded model's modules at the kernels, or leaves them on the reference.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
from torch import nn

from worker.models.layers import GatedActivation, RMSNorm
from worker.models.rotary import RotaryEmbedding

ELEMENTWISE_BACKENDS = ("auto", "reference", "triton")
# Activations the fused gated kernel computes (SwiGLU); the others keep the torch code.
_FUSED_ACTIVATIONS = ("silu", "swish")


def select_kernels(backend: str, device: torch.device) -> ModuleType | None:
    """The kernels for `backend` (one of ELEMENTWISE_BACKENDS), or None for the reference.

    "auto" is triton on CUDA when it imports, the reference elsewhere. "triton" off CUDA runs
    the kernels in Triton's interpreter (TRITON_INTERPRET=1), which only tests want.
    """
    if backend not in ELEMENTWISE_BACKENDS:
        raise ValueError(f"elementwise kernels must be one of {ELEMENTWISE_BACKENDS}: {backend!r}")
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return None
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("elementwise kernels 'triton' need CUDA (or TRITON_INTERPRET=1, tests)")
    try:
        from worker.models import triton_ops
    except ImportError as exc:
        if backend == "triton":
            raise ValueError(f"elementwise kernels 'triton' need triton: {exc}") from exc
        return None
    return triton_ops


def use_kernels(model: nn.Module, kernels: ModuleType | None) -> str:
    """Point every fusable module of `model` at `kernels` (None: back to the reference) and
    return the name of what runs: "triton" or "reference"."""
    for module in model.modules():
        if _fusable(module):
            module.kernels = kernels
    return "reference" if kernels is None else "triton"


def _fusable(module: nn.Module) -> bool:
    if isinstance(module, GatedActivation):
        return module.act_name in _FUSED_ACTIVATIONS
    return isinstance(module, (RMSNorm, RotaryEmbedding))
