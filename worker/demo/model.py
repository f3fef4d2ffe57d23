"""The demo model: a tiny LLaVA-1.5-style model in Hugging Face format, generated, never downloaded.

Everything is derived from constants (a fixed corpus for the byte-level BPE in tokenizer.py, a
fixed seed for the weights here), so every run writes byte-identical files and every machine gets
the same tokenizer, template and keys. Writing it needs numpy and safetensors, never torch. Its
two LoRA adapters are generated the same way (worker/demo/lora.py).

    python -m worker.demo OUTDIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from worker.demo.tokenizer import (
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    IM_END_ID,
    IMAGE_ID,
    UNK_ID,
    build_tokenizer,
)

DEMO_VERSION = "demo-model-v1"
SEED = 20261122

TEXT = dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, max_positions=4096)
VISION = dict(hidden=64, intermediate=128, layers=2, heads=4, image_size=64, patch_size=8)


def _text_config(vocab_size: int) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": TEXT["hidden"],
        "intermediate_size": TEXT["intermediate"],
        "num_hidden_layers": TEXT["layers"],
        "num_attention_heads": TEXT["heads"],
        "num_key_value_heads": TEXT["kv_heads"],
        "max_position_embeddings": TEXT["max_positions"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": UNK_ID,
        "torch_dtype": "float32",
    }


def _vision_config() -> dict:
    return {
        "model_type": "clip_vision_model",
        "hidden_size": VISION["hidden"],
        "intermediate_size": VISION["intermediate"],
        "num_hidden_layers": VISION["layers"],
        "num_attention_heads": VISION["heads"],
        "image_size": VISION["image_size"],
        "patch_size": VISION["patch_size"],
        "projection_dim": VISION["hidden"],
        "num_channels": 3,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5,
    }


def _configs(vocab_size: int) -> dict[str, dict]:
    tokens_per_side = VISION["image_size"] // VISION["patch_size"]
    text_config, vision_config = _text_config(vocab_size), _vision_config()
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": IMAGE_ID,
        "image_seq_length": tokens_per_side**2,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "text_config": text_config,
        "vision_config": vision_config,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<unk>",
        "model_max_length": TEXT["max_positions"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    preprocessor_config = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_resize": True,
        "size": {"shortest_edge": VISION["image_size"]},
        "do_center_crop": True,
        "crop_size": {"height": VISION["image_size"], "width": VISION["image_size"]},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
        "resample": 3,
    }
    generation_config = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]}
    return {
        "config.json": config,
        "tokenizer_config.json": tokenizer_config,
        "preprocessor_config.json": preprocessor_config,
        "generation_config.json": generation_config,
    }


def llama_layer_shapes(prefix: str, h: int, kv: int, inter: int) -> dict[str, tuple[int, ...]]:
    """One Llama decoder layer's weight shapes (`kv` = KV heads x head dim), in file order."""
    return {
        prefix + "self_attn.q_proj.weight": (h, h),
        prefix + "self_attn.k_proj.weight": (kv, h),
        prefix + "self_attn.v_proj.weight": (kv, h),
        prefix + "self_attn.o_proj.weight": (h, h),
        prefix + "mlp.gate_proj.weight": (inter, h),
        prefix + "mlp.up_proj.weight": (inter, h),
        prefix + "mlp.down_proj.weight": (h, inter),
        prefix + "input_layernorm.weight": (h,),
        prefix + "post_attention_layernorm.weight": (h,),
    }


def _weight_shapes(vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the classic llava-hf checkpoint layout, by name."""
    h, i, kv = (
        TEXT["hidden"],
        TEXT["intermediate"],
        TEXT["hidden"] // TEXT["heads"] * TEXT["kv_heads"],
    )
    vh, vi = VISION["hidden"], VISION["intermediate"]
    n_pos = (VISION["image_size"] // VISION["patch_size"]) ** 2 + 1
    shapes: dict[str, tuple[int, ...]] = {
        "language_model.model.embed_tokens.weight": (vocab_size, h),
        "language_model.model.norm.weight": (h,),
        "language_model.lm_head.weight": (vocab_size, h),
        "multi_modal_projector.linear_1.weight": (h, vh),
        "multi_modal_projector.linear_1.bias": (h,),
        "multi_modal_projector.linear_2.weight": (h, h),
        "multi_modal_projector.linear_2.bias": (h,),
    }
    for n in range(TEXT["layers"]):
        shapes |= llama_layer_shapes(f"language_model.model.layers.{n}.", h, kv, i)
    v = "vision_tower.vision_model."
    shapes.update(
        {
            v + "embeddings.class_embedding": (vh,),
            v + "embeddings.patch_embedding.weight": (
                vh,
                3,
                VISION["patch_size"],
                VISION["patch_size"],
            ),
            v + "embeddings.position_embedding.weight": (n_pos, vh),
            v + "pre_layrnorm.weight": (vh,),
            v + "pre_layrnorm.bias": (vh,),
            v + "post_layernorm.weight": (vh,),
            v + "post_layernorm.bias": (vh,),
        }
    )
    for n in range(VISION["layers"]):
        p = f"{v}encoder.layers.{n}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{p}self_attn.{proj}.weight"] = (vh, vh)
            shapes[f"{p}self_attn.{proj}.bias"] = (vh,)
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{p}{norm}.weight"] = (vh,)
            shapes[f"{p}{norm}.bias"] = (vh,)
        shapes.update(
            {
                p + "mlp.fc1.weight": (vi, vh),
                p + "mlp.fc1.bias": (vi,),
                p + "mlp.fc2.weight": (vh, vi),
                p + "mlp.fc2.bias": (vh,),
            }
        )
    return shapes


def build_weights(vocab_size: int) -> dict[str, np.ndarray]:
    """Seeded weights: N(0, 0.02) matrices, unit norm scales, zero biases."""
    rng = np.random.default_rng(SEED)
    weights = {}
    for name, shape in sorted(_weight_shapes(vocab_size).items()):
        is_norm = "norm" in name or "layrnorm" in name
        if is_norm and name.endswith("weight"):
            weights[name] = np.ones(shape, dtype=np.float32)
        elif name.endswith("bias"):
            weights[name] = np.zeros(shape, dtype=np.float32)
        else:
            weights[name] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
    return weights


def dump_json(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def write_demo_model(path: str | os.PathLike[str]) -> Path:
    """Write the demo model into `path` (created if needed); byte-identical on every run."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    (out / "tokenizer.json").write_bytes(tokenizer.to_str(pretty=True).encode("utf-8") + b"\n")
    for name, obj in _configs(vocab_size).items():
        (out / name).write_bytes(dump_json(obj))
    save_file(build_weights(vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def cache_root() -> Path:
    """Where generated models live: $KVGATE_CACHE_DIR, else ~/.cache/kvgate."""
    root = os.environ.get("KVGATE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "kvgate"


def default_cache_dir() -> Path:
    return cache_root() / DEMO_VERSION


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """The demo model directory, written once; safe when several processes race to create it.

    Each writer fills a private temp dir and renames it into place; the first rename wins and
    the others discard their copy, so a reader never sees a half-written directory.
    """
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not (target / "model.safetensors").is_file():
        write_atomically(target, write_demo_model)
    return target


def write_atomically(target: Path, write) -> None:
    """`write(tmp)` into a private temp dir, renamed into place; the first rename wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir() or not any(target.iterdir()):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m worker.demo OUTDIR", file=sys.stderr)
        return 2
    print(write_demo_model(argv[0]))
    return 0
