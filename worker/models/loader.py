"""load_model: a local Hugging Face directory (config.json + safetensors) -> a ready nn.Module.

No transformers at runtime: config.json is read as a dict, weights with safetensors' torch API.
The model is built on the meta device and materialised once at its final device and dtype, so
no memory or time goes to random initialisation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.models.elementwise import select_kernels, use_kernels
from worker.models.llama import LlamaForCausalLM, ignored_checkpoint_weight
from worker.models.llava import LlavaForConditionalGeneration
from worker.models.registry import ModelInfo, model_info, resolve_architecture
from worker.models.weights import iter_checkpoint, load_weights

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

# LLaVA checkpoint layouts onto our (classic llava-hf) module names. transformers 4.x from 4.52
# writes `model.language_model.*`, `model.vision_tower.vision_model.*`, `lm_head.*`; transformers 5
# writes `language_model.model.*` and a CLIP tower without its `vision_model.` level:
# `vision_tower.{embeddings,pre_layrnorm,encoder,post_layernorm}.*` (its in-memory state dict has
# `model.vision_tower.embeddings.*`).
_LLAVA_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)
_TOWER = "vision_tower."
_TOWER_CLASSIC = "vision_tower.vision_model."


def read_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    return json.loads(path.read_text())


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(
    dtype: str | torch.dtype, config: dict[str, Any], device: torch.device
) -> torch.dtype:
    """ "auto": float32 on CPU; on GPU the checkpoint's half dtype, else bfloat16 (or float16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    saved = _DTYPES.get(str(config.get("torch_dtype") or config.get("dtype") or ""))
    if saved in (torch.bfloat16, torch.float16):
        return saved
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def llava_checkpoint_name(name: str) -> str:
    """Map every llava-hf weight layout (transformers 4.x and 5.x) onto our classic names."""
    for new, classic in _LLAVA_RENAMES:
        if name.startswith(new):
            name = classic + name[len(new) :]
            break
    if name.startswith(_TOWER) and not name.startswith(_TOWER_CLASSIC):
        name = _TOWER_CLASSIC + name[len(_TOWER) :]
    return name


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """`model.to(dtype).to_empty(device=device)` for a model built on the meta device: every
    parameter uninitialised on `device`, floating ones in `dtype` (the checkpoint fills them).
    Not `to_empty` itself: its `empty_like` of a meta tensor runs torch's Python decompositions,
    which import sympy, a third of a second of every worker's start. Shared parameters come
    out unshared, as from `to_empty` (the models' `tie_weights` re-shares them)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            kind = dtype if p.is_floating_point() else p.dtype
            empty = torch.empty(p.shape, dtype=kind, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            kind = dtype if b.is_floating_point() else b.dtype
            module._buffers[name] = torch.empty(b.shape, dtype=kind, device=device)  # as _apply


def load_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    elementwise: str = "reference",
) -> nn.Module:
    """Build the model of a local HF directory and load its weights strictly.

    The returned module is in eval mode and carries `.info` (a ModelInfo) and `.elementwise`:
    what runs its norms, rotary and SwiGLU (`elementwise` is one of ELEMENTWISE_BACKENDS).
    """
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    target_device = resolve_device(device)
    target_dtype = resolve_dtype(dtype, config, target_device)
    cls = resolve_architecture(config)
    with torch.device("meta"):
        model = cls.from_hf_config(config)
    materialize(model, target_dtype, target_device)
    model.tie_weights()

    if isinstance(model, LlavaForConditionalGeneration):
        text_config = model.config.text

        def ignore(name: str) -> bool:
            # Checkpoints from older transformers saved CLIP's position_ids buffer.
            if name.endswith("embeddings.position_ids"):
                return True
            return ignored_checkpoint_weight(name, text_config)

        load_weights(model, iter_checkpoint(model_dir), rename=llava_checkpoint_name, ignore=ignore)
    else:
        assert isinstance(model, LlamaForCausalLM)
        llama_config = model.config
        load_weights(
            model,
            iter_checkpoint(model_dir),
            ignore=lambda name: ignored_checkpoint_weight(name, llama_config),
        )
    model.eval()
    model.info = model_info(config, target_dtype)
    model.elementwise = use_kernels(model, select_kernels(elementwise, target_device))
    return model


def read_model_info(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> ModelInfo:
    """ModelInfo without loading weights (the sim engine and KV sizing)."""
    return model_info(read_config(Path(model_dir)), dtype)
