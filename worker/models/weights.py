"""Reading safetensors checkpoints and copying them, strictly, into a model's parameters."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from worker.models.layers import MergedLinear

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """A model directory's safetensors files (the index's shards, or every *.safetensors)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} names shards that are not there: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in model_dir.iterdir())
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (found {found})")
    return files


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of every checkpoint file; a ValueError naming the file when one cannot be
    read (a download cut short), where safetensors' own error names neither."""
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e})") from e


def _merged_shards(model: nn.Module) -> dict[str, tuple[str, str]]:
    """checkpoint module path (…q_proj) -> (merged module path (…qkv_proj), shard name)."""
    shards: dict[str, tuple[str, str]] = {}
    for path, module in model.named_modules():
        if isinstance(module, MergedLinear):
            parent = path.rpartition(".")[0]
            for shard in module.shard_names:
                shards[f"{parent}.{shard}" if parent else shard] = (path, shard)
    return shards


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, Tensor]],
    *,
    rename: Callable[[str], str] = lambda name: name,
    ignore: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy every checkpoint tensor into its parameter; raise on unknown, missing or misshapen ones.

    Checkpoint q/k/v (gate/up) projections land in their slice of the merged projection.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    shards = _merged_shards(model)
    loaded: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for raw_name, tensor in weights:
            name = rename(raw_name)
            if ignore(name):
                continue
            module_path, _, leaf = name.rpartition(".")
            if name in params:
                _copy(params[name], tensor, raw_name)
                loaded.add((name, None))
            elif module_path in shards:
                merged_path, shard = shards[module_path]
                merged = modules[merged_path]
                param_name = f"{merged_path}.{leaf}"
                if param_name not in params:
                    unexpected.append(raw_name)
                    continue
                start, size = merged.shard_offset(shard)
                _copy(params[param_name].narrow(0, start, size), tensor, raw_name)
                loaded.add((param_name, shard))
            else:
                unexpected.append(raw_name)
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected weights: {unexpected[:10]}")
    missing = [key for key in _expected(params, modules) if key not in loaded]
    if missing:
        shown = [name if shard is None else f"{name}[{shard}]" for name, shard in missing[:10]]
        raise ValueError(f"checkpoint lacks {len(missing)} weights: {shown}")


def _expected(
    params: dict[str, nn.Parameter], modules: dict[str, nn.Module]
) -> list[tuple[str, str | None]]:
    expected: list[tuple[str, str | None]] = []
    for name in params:
        module = modules.get(name.rpartition(".")[0])
        if isinstance(module, MergedLinear):
            expected.extend((name, shard) for shard in module.shard_names)
        else:
            expected.append((name, None))
    return expected


def _copy(target: Tensor, tensor: Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"weight {name} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    target.copy_(tensor)
