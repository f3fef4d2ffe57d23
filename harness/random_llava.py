"""The demo LLaVA with a bigger, random-weight language model, for benchmarks whose figure is
prefill time: on the demo model (hidden 128, 2 layers) a request's TTFT is mostly HTTP and
rendering, so a saved prefill does not show.

    write_random_llava(path, "llava-cpu")

Everything but the language model and the projector is the demo's (tokenizer, chat template,
image processor, vision tower), so prompts render and key exactly as on the demo model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from worker.demo.model import ensure_demo_model, llama_layer_shapes

# Prefill dominates a CPU request's TTFT (about 0.2 ms per prompt token on one thread).
SHAPES: dict[str, dict[str, int]] = {
    "llava-cpu": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
}


def _text_shapes(text: dict, vision_hidden: int) -> dict[str, tuple[int, ...]]:
    h, inter = text["hidden_size"], text["intermediate_size"]
    kv = text["num_key_value_heads"] * (h // text["num_attention_heads"])
    shapes: dict[str, tuple[int, ...]] = {
        "language_model.model.embed_tokens.weight": (text["vocab_size"], h),
        "language_model.model.norm.weight": (h,),
        "language_model.lm_head.weight": (text["vocab_size"], h),
        "multi_modal_projector.linear_1.weight": (h, vision_hidden),
        "multi_modal_projector.linear_1.bias": (h,),
        "multi_modal_projector.linear_2.weight": (h, h),
        "multi_modal_projector.linear_2.bias": (h,),
    }
    for i in range(text["num_hidden_layers"]):
        shapes |= llama_layer_shapes(f"language_model.model.layers.{i}.", h, kv, inter)
    return shapes


def write_random_llava(path: Path, shape: str) -> Path:
    """Write the model (float32) into `path` unless it is there; returns `path`."""
    if (path / "model.safetensors").is_file():
        return path
    demo = ensure_demo_model()
    config = json.loads((demo / "config.json").read_text())
    config["text_config"].update(SHAPES[shape])
    shapes = _text_shapes(config["text_config"], config["vision_config"]["hidden_size"])
    count = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"writing a LLaVA with {count / 1e6:.0f}M random text parameters to {path}", flush=True)
    tensors = {k: v for k, v in load_file(demo / "model.safetensors").items() if "vision" in k}
    gen = torch.Generator().manual_seed(0)
    for name, size in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(size)
        elif name.endswith("bias"):
            tensors[name] = torch.zeros(size)
        else:
            tensors[name] = torch.randn(size, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    for f in demo.iterdir():
        if f.suffix == ".json" and f.name != "config.json":
            shutil.copy(f, path / f.name)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(path / "model.safetensors.tmp"), metadata={"format": "pt"})
    (path / "model.safetensors.tmp").rename(path / "model.safetensors")
    return path
