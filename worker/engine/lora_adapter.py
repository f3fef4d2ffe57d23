"""PEFT LoRA adapters on disk: read one and check it against the base model, without torch.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` (PEFT's layout).
Everything that can be wrong is found here, before a weight reaches the engine: the path, the
config, the rank against `max_lora_rank`, the target modules (the attention and MLP projections
of the language model) and every matrix's shape against the base model's projection. Only the
safetensors header is read; the torch runner loads the tensors (worker/models/lora.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# Projection -> the decoder sub-module it lives in.
PROJECTIONS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# PEFT's key: base_model.model.<module path>.lora_A[.<adapter name>].weight. The module path ends
# in layers.N.<self_attn|mlp>.<proj>; whatever precedes `layers.` (model., language_model.model.,
# model.language_model.) names the language model in the Llama and LLaVA layouts.
_KEY = re.compile(
    r"^base_model\.model\.(?P<prefix>(?:[\w]+\.)*?)layers\.(?P<layer>\d+)\."
    r"(?P<block>self_attn|mlp)\.(?P<proj>\w+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$"
)
_UNSUPPORTED = {
    "use_dora": "DoRA adapters",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "modules_to_save",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters",
}


class LoRAError(ValueError):
    """A LoRA request or adapter the client must fix: the HTTP status and the field to blame."""

    def __init__(
        self, message: str, status_code: int = 400, *, param: str | None = None, code=None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class BaseShapes:
    """The base model's projections an adapter may target: (in_features, out_features) each."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> BaseShapes:
        """From a config.json dict (a LLaVA's `text_config` is its language model)."""
        text = config.get("text_config") or config
        hidden = int(text.get("hidden_size", 4096))
        inter = int(text.get("intermediate_size", 11008))
        heads = int(text.get("num_attention_heads", 32))
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // heads)
        q, kv = heads * head_dim, kv_heads * head_dim
        shapes = {
            "q_proj": (hidden, q),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "o_proj": (q, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        return cls(int(text.get("num_hidden_layers", 32)), shapes)


@dataclass(frozen=True, slots=True, eq=False)
class LoRAAdapter:
    """One registered adapter. `id` is unique per registration: a name loaded again after an
    unload is a different adapter while requests of the old one still run."""

    id: int
    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r (or / sqrt(r) with rsLoRA), folded into B when loaded
    weights_file: Path
    # (layer, projection) -> (key of lora_A [r, in], key of lora_B [out, r]) in weights_file
    modules: dict[tuple[int, str], tuple[str, str]]


def read_adapter(
    adapter_id: int, name: str, path: str, base: BaseShapes, max_rank: int
) -> LoRAAdapter:
    """Read and check the adapter at `path`; LoRAError (404 for a missing one, else 400)."""
    root = Path(path)
    config_file = root / CONFIG_FILE
    if not config_file.is_file():
        raise LoRAError(
            f"Loading lora {name} failed: No adapter found for {path}", 404, param="lora_path"
        )
    config = _read_config(config_file, name)
    rank, scaling = _rank_and_scaling(config, name, max_rank)
    weights_file = root / WEIGHTS_FILE
    if not weights_file.is_file():
        found = sorted(p.name for p in root.iterdir())
        raise LoRAError(
            f"Loading lora {name} failed: no {WEIGHTS_FILE} in {path} (found {found}); "
            "only safetensors adapters are read",
            param="lora_path",
        )
    modules = _check_weights(weights_file, name, rank, base)
    return LoRAAdapter(adapter_id, name, str(path), rank, scaling, weights_file, modules)


def _read_config(config_file: Path, name: str) -> dict[str, Any]:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"Loading lora {name} failed: unreadable {CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"Loading lora {name} failed: {CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"Loading lora {name} failed: peft_type {peft_type!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise LoRAError(f"Loading lora {name} failed: {what} are not supported")
    bias = config.get("bias", "none")
    if bias != "none":
        raise LoRAError(f"Loading lora {name} failed: LoRA bias {bias!r} is not supported")
    return config


def _rank_and_scaling(config: dict[str, Any], name: str, max_rank: int) -> tuple[int, float]:
    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"Loading lora {name} failed: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAError(f"Loading lora {name} failed: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise LoRAError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _check_weights(
    weights_file: Path, name: str, rank: int, base: BaseShapes
) -> dict[tuple[int, str], tuple[str, str]]:
    """(layer, projection) -> (A key, B key), every shape checked against the base model."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    unsupported: list[str] = []
    try:
        with safe_open(str(weights_file), framework="numpy") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types for a corrupt file
        raise LoRAError(f"Loading lora {name} failed: unreadable {WEIGHTS_FILE}: {e}") from None
    for key in sorted(shapes):
        m = _KEY.match(key)
        if m is None or "vision" in m["prefix"] or PROJECTIONS.get(m["proj"]) != m["block"]:
            unsupported.append(key)
            continue
        pairs.setdefault((int(m["layer"]), m["proj"]), {})[m["ab"]] = key
    if unsupported:
        raise LoRAError(
            f"Loading lora {name} failed: weights for modules this engine does not adapt: "
            f"{unsupported[:5]} (LoRA applies to the q/k/v/o and gate/up/down projections "
            "of the language model)"
        )
    if not pairs:
        raise LoRAError(f"Loading lora {name} failed: {WEIGHTS_FILE} holds no LoRA weights")
    modules = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"Loading lora {name} failed: layer {layer} {proj} lacks lora_A or B")
        _check_shapes(name, layer, proj, shapes[ab["A"]], shapes[ab["B"]], rank, base)
        modules[(layer, proj)] = (ab["A"], ab["B"])
    return modules


def _check_shapes(
    name: str,
    layer: int,
    proj: str,
    a: tuple[int, ...],
    b: tuple[int, ...],
    rank: int,
    base: BaseShapes,
) -> None:
    where = f"layer {layer} {proj}"
    if layer >= base.num_layers:
        raise LoRAError(
            f"LoRA adapter {name} is incompatible with the base model: it adapts layer {layer}, "
            f"the base model has {base.num_layers} layers"
        )
    in_features, out_features = base.shapes[proj]
    if a != (rank, in_features) or b != (out_features, rank):
        raise LoRAError(
            f"LoRA adapter {name} is incompatible with the base model: {where} has lora_A "
            f"{list(a)} and lora_B {list(b)}; rank {rank} on this base model needs "
            f"[{rank}, {in_features}] and [{out_features}, {rank}]"
        )
