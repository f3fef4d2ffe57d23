"""Random-weight Llama checkpoints of real shapes, for benchmarks on hardware with no model files.

    write_random_llama(path, "llama-1b", device="cuda")

The directory is a Hugging Face layout (config.json, model.safetensors, the demo tokenizer), so
both the engine and transformers load it. Weights are N(0, 0.02) with unit norms, as transformers
initialises a Llama: activations stay finite, outputs are meaningless. Token ids are what the
benchmarks send; the demo tokenizer only makes the directory complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from worker.demo.model import ensure_demo_model, llama_layer_shapes
from worker.demo.tokenizer import VOCAB_SIZE as DEMO_VOCAB


def _llama(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int
) -> dict[str, int]:
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )


SHAPES: dict[str, dict[str, int]] = {
    # A smoke-test shape: the GPU suite's code paths in seconds on a CPU.
    "llama-tiny": _llama(64, 128, layers=2, heads=4, kv_heads=2),
    # Big enough that prefill dominates a CPU server's time, small enough for four on 2 cores
    # (bench.ttft --engine vllm); the demo tokenizer's vocabulary, so every token it samples
    # decodes to text (TTFT is the first chunk with content).
    "llama-6x384": _llama(384, 1024, layers=6, heads=6, kv_heads=2) | {"vocab_size": DEMO_VOCAB},
    "llama-1b": _llama(2048, 8192, layers=16, heads=32, kv_heads=8),
    "llama-3b": _llama(3072, 8192, layers=28, heads=24, kv_heads=8),
    "llama-8b": _llama(4096, 14336, layers=32, heads=32, kv_heads=8),
}
VOCAB_SIZE = 128256
MAX_POSITIONS = 131072


def llama_config(shape: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        **SHAPES[shape],
    }


def _weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg["vocab_size"], h),
    }
    for i in range(cfg["num_hidden_layers"]):
        shapes |= llama_layer_shapes(f"model.layers.{i}.", h, kv, inter)
    return shapes


def write_random_llama(path: Path, shape: str, device: str = "cpu") -> int:
    """Write the checkpoint (bfloat16) unless it is there; returns the parameter count."""
    cfg = llama_config(shape)
    shapes = _weight_shapes(cfg)
    count = sum(torch.Size(s).numel() for s in shapes.values())
    if (path / "model.safetensors").is_file():
        return count
    path.mkdir(parents=True, exist_ok=True)
    print(f"writing {count / 1e9:.2f}e9 random bfloat16 parameters to {path}", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, size in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(size, dtype=torch.bfloat16)
        else:
            w = torch.randn(size, generator=gen, device=device, dtype=torch.float32) * 0.02
            tensors[name] = w.to(torch.bfloat16).cpu()
    save_file(tensors, str(path / "model.safetensors.tmp"), metadata={"format": "pt"})
    demo = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (demo / name).is_file():
            shutil.copy(demo / name, path / name)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "model.safetensors.tmp").rename(path / "model.safetensors")
    return count
