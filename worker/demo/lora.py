"""The demo model's two LoRA adapters, generated like the model: seeded, byte-identical, no torch.

They are in PEFT's layout (adapter_config.json + adapter_model.safetensors, keys
`base_model.model.<module>.lora_A.weight`): `alpha` adapts every attention and MLP projection of
the language model (r=8), `beta` only q, v and down (r=4). B is far from PEFT's zero init, so
each adapter visibly changes what the model says.

    python -m worker.demo.lora      # writes them once; prints alpha=PATH,beta=PATH
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from worker.demo.model import SEED, TEXT, default_cache_dir, dump_json, write_atomically

# name -> (seed, rank, lora_alpha, target projections)
DEMO_ADAPTERS: dict[str, tuple[int, int, int, tuple[str, ...]]] = {
    "alpha": (
        1,
        8,
        16,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    ),
    "beta": (2, 4, 8, ("q_proj", "v_proj", "down_proj")),
}
ADAPTERS_VERSION = "demo-lora-v1"


def _projection_shapes() -> dict[str, tuple[int, int]]:
    h, i = TEXT["hidden"], TEXT["intermediate"]
    kv = h // TEXT["heads"] * TEXT["kv_heads"]
    return {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def write_demo_adapter(path: str | os.PathLike[str], name: str) -> Path:
    """Write demo adapter `name` into `path` as PEFT saves one (seeded: byte-identical)."""
    seed, rank, alpha, targets = DEMO_ADAPTERS[name]
    rng = np.random.default_rng(SEED + seed)
    shapes = _projection_shapes()
    weights = {}
    for n in range(TEXT["layers"]):
        for proj in targets:
            block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.language_model.model.layers.{n}.{block}.{proj}"
            in_f, out_f = shapes[proj]
            # B far from PEFT's zero init, so the adapter visibly changes what the model says.
            weights[f"{key}.lora_A.weight"] = _normal(rng, (rank, in_f), 0.05)
            weights[f"{key}.lora_B.weight"] = _normal(rng, (out_f, rank), 0.2)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "demo",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        # A regex, so that PEFT adapts the language model only (CLIP has q/k/v_proj too).
        "target_modules": rf".*language_model.*\.({'|'.join(sorted(targets))})",
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_bytes(dump_json(config))
    save_file(weights, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def _normal(rng: np.random.Generator, shape: tuple[int, int], std: float) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)


def ensure_demo_adapters(cache_dir: Path | None = None) -> dict[str, Path]:
    """The demo adapters' directories (name -> path), written once beside the demo model."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir().parent
    paths = {}
    for name in DEMO_ADAPTERS:
        target = root / ADAPTERS_VERSION / name
        paths[name] = target
        if not (target / "adapter_model.safetensors").is_file():
            write_atomically(target, lambda tmp, name=name: write_demo_adapter(tmp, name))
    return paths


def lora_modules_arg(paths: dict[str, Path]) -> str:
    """`--lora-modules` for the given adapters: name=path,name=path."""
    return ",".join(f"{name}={path}" for name, path in paths.items())


def main(argv: list[str]) -> int:
    if argv:
        print("usage: python -m worker.demo.lora", file=sys.stderr)
        return 2
    print(lora_modules_arg(ensure_demo_adapters()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
