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

from cachekey.demo import ensure_demo_model

SHAPES: dict[str, dict[str, int]] = {
    # A smoke-test shape: the GPU suite's code paths in seconds on a CPU.
    "llama-tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "llama-3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
    ),
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
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
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
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
