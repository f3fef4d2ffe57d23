"""The hybrid demo model: a tiny Gemma-3-style text model (sliding-window and full-attention layers
alternating), generated like the demo model and sharing its tokenizer and chat template.

A serving engine keeps two KV-cache groups for it, as for Gemma 3 or GPT-OSS: vLLM's sliding-window
group caches only the blocks a later hit can use, and its prefix cache hits a prompt only where
the sliding-window layers hold the last `SLIDING_WINDOW` tokens before the match end
(docs/gateway.md, "vLLM workers"). The real-vLLM suite (tests/system/test_vllm_real.py) serves it;
kvgate's own engine does not (it has no Gemma 3 layers). Needs numpy and safetensors, never torch.

    python -m worker.demo.hybrid OUTDIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from worker.demo.model import _configs, cache_root, dump_json, write_atomically
from worker.demo.tokenizer import BOS_ID, EOS_ID, IM_END_ID, UNK_ID, build_tokenizer

HYBRID_VERSION = "demo-hybrid-v1"
SEED = 20261126
SLIDING_WINDOW = 64  # tokens: two 32-token blocks, the smallest block size vLLM's CPU build takes
SHAPE = dict(hidden=128, intermediate=256, layers=4, heads=4, kv_heads=2, head_dim=32)
MAX_POSITIONS = 4096


def hybrid_config(vocab_size: int) -> dict:
    s = SHAPE
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab_size,
        "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * (s["layers"] // 2),
        "rope_parameters": {
            "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "query_pre_attn_scalar": s["head_dim"],
        "attention_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": UNK_ID,
        "torch_dtype": "float32",
    }


def _weight_shapes(vocab_size: int) -> dict[str, tuple[int, ...]]:
    s = SHAPE
    h, i, hd = s["hidden"], s["intermediate"], s["head_dim"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab_size, h),
        "model.norm.weight": (h,),
    }
    for n in range(s["layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            shapes[f"{p}{norm}_layernorm.weight"] = (h,)
    return shapes


def build_weights(vocab_size: int) -> dict[str, np.ndarray]:
    """Seeded N(0, 0.02) matrices; norm weights 0 (Gemma's RMSNorm scales by 1 + weight)."""
    rng = np.random.default_rng(SEED)
    weights = {}
    for name, shape in sorted(_weight_shapes(vocab_size).items()):
        if "norm" in name:
            weights[name] = np.zeros(shape, dtype=np.float32)
        else:
            weights[name] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
    return weights


def write_hybrid_model(path: str | os.PathLike[str]) -> Path:
    """Write the hybrid demo model into `path`; byte-identical on every run."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    (out / "tokenizer.json").write_bytes(tokenizer.to_str(pretty=True).encode("utf-8") + b"\n")
    demo = _configs(vocab_size)
    files = {
        "config.json": hybrid_config(vocab_size),
        "tokenizer_config.json": demo["tokenizer_config.json"],
        "generation_config.json": {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]},
    }
    for name, obj in files.items():
        (out / name).write_bytes(dump_json(obj))
    save_file(build_weights(vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def default_hybrid_dir() -> Path:
    return cache_root() / HYBRID_VERSION


def ensure_hybrid_model(cache_dir: Path | None = None) -> Path:
    """The hybrid model directory, written once (atomically, as `ensure_demo_model`)."""
    target = Path(cache_dir) if cache_dir is not None else default_hybrid_dir()
    if not (target / "model.safetensors").is_file():
        write_atomically(target, write_hybrid_model)
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m worker.demo.hybrid OUTDIR", file=sys.stderr)
        return 2
    print(write_hybrid_model(argv[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
