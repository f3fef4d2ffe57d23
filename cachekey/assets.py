"""Model assets: everything the renderer needs from a model directory, and nothing that needs torch.

A gateway without a local copy fetches the raw files from a worker (`from_files`), so both build
the same `ModelAssets` from the same bytes, and `fingerprint()` proves it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from cachekey.template import compile_template

# The small files the renderer reads; weights never travel.
ASSET_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
DEFAULT_MAX_MODEL_LEN = 2048  # transformers' LlamaConfig default, for configs that omit it


class AssetError(ValueError):
    """A model directory that lacks or garbles a file the renderer needs."""


@dataclass(frozen=True, slots=True)
class ImageConfig:
    """How one image becomes placeholder tokens (LLaVA-1.5 style: a fixed count per image)."""

    image_token_id: int
    image_token: str
    tokens_per_image: int
    image_size: int
    patch_size: int
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)

    def __post_init__(self) -> None:
        if self.tokens_per_image <= 0 or self.image_size <= 0 or self.patch_size <= 0:
            raise AssetError(f"invalid image settings: {self}")


@dataclass(slots=True)
class ModelAssets:
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]
    image: ImageConfig | None
    max_model_len: int
    files: dict[str, bytes] = field(repr=False)
    chat_templates: dict[str, str] = field(default_factory=dict, repr=False)
    _compiled: jinja2.Template | None = field(default=None, init=False, repr=False)
    _fingerprint: str | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> ModelAssets:
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise AssetError(f"{root} has no tokenizer.json (only fast tokenizers are supported)")
        files = {n: (root / n).read_bytes() for n in ASSET_FILES if (root / n).is_file()}
        return cls.from_files(files)

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> ModelAssets:
        if "tokenizer.json" not in files:
            raise AssetError("asset files lack tokenizer.json")
        try:
            tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        except Exception as e:  # tokenizers raises bare Exception on bad JSON
            raise AssetError(f"tokenizer.json does not load: {e}") from e
        tok_cfg = _json(files, "tokenizer_config.json")
        special = _json(files, "special_tokens_map.json")
        config = _json(files, "config.json")
        bos = _token_text(tok_cfg.get("bos_token", special.get("bos_token")))
        eos = _token_text(tok_cfg.get("eos_token", special.get("eos_token")))
        template, named = _chat_templates(files, tok_cfg)
        return cls(
            tokenizer=tokenizer,
            chat_template=template,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=_eos_ids(tokenizer, eos, config, _json(files, "generation_config.json")),
            image=_image_config(tokenizer, config, _json(files, "preprocessor_config.json")),
            max_model_len=_max_model_len(config),
            files=dict(files),
            chat_templates=named,
        )

    def compiled_template(self) -> jinja2.Template | None:
        """The chat template, compiled on first use and kept."""
        if self._compiled is None and self.chat_template is not None:
            self._compiled = compile_template(self.chat_template)
        return self._compiled

    def fingerprint_parts(self) -> dict[str, str]:
        """Digests of each thing that determines rendered tokens, for diagnosing a mismatch."""
        image = None
        if self.image is not None:
            image = {
                "image_token_id": self.image.image_token_id,
                "tokens_per_image": self.image.tokens_per_image,
                "image_size": self.image.image_size,
                "patch_size": self.image.patch_size,
            }
        return {
            "tokenizer": _sha(self.files["tokenizer.json"]),
            "chat_template": _sha((self.chat_template or "").encode("utf-8")),
            "special_tokens": _sha(json.dumps([self.bos_token, self.eos_token]).encode("utf-8")),
            "image": _sha(json.dumps(image, sort_keys=True).encode("utf-8")),
        }

    def fingerprint(self) -> str:
        """One sha256 hex digest over every part; equal fingerprints render equal tokens."""
        if self._fingerprint is None:
            parts = self.fingerprint_parts()
            blob = "".join(f"{k}={parts[k]};" for k in sorted(parts)).encode("utf-8")
            self._fingerprint = _sha(blob)
        return self._fingerprint


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _json(files: dict[str, bytes], name: str) -> dict[str, Any]:
    if name not in files:
        return {}
    try:
        value = json.loads(files[name])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AssetError(f"{name} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise AssetError(f"{name} must hold a JSON object")
    return value


def _token_text(token: Any) -> str | None:
    """bos/eos appear as a string or as a serialized AddedToken {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _chat_templates(files: dict[str, bytes], tok_cfg: dict[str, Any]) -> tuple[str | None, dict]:
    """The default chat template and any named ones; chat_template.jinja takes precedence."""
    named: dict[str, str] = {}
    raw = tok_cfg.get("chat_template")
    if raw is None and "chat_template.json" in files:
        raw = _json(files, "chat_template.json").get("chat_template")
    if isinstance(raw, list):
        named = {t["name"]: t["template"] for t in raw if isinstance(t, dict) and "name" in t}
        raw = named.get("default")
    if "chat_template.jinja" in files:
        raw = files["chat_template.jinja"].decode("utf-8")
    return (raw if isinstance(raw, str) else None), named


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _eos_ids(
    tokenizer: Tokenizer, eos: str | None, config: dict[str, Any], gen: dict[str, Any]
) -> tuple[int, ...]:
    text_cfg = config.get("text_config") or {}
    ids = _ids(gen.get("eos_token_id")) + _ids(config.get("eos_token_id"))
    ids += _ids(text_cfg.get("eos_token_id"))
    if eos is not None and (tid := tokenizer.token_to_id(eos)) is not None:
        ids.append(tid)
    return tuple(dict.fromkeys(ids))


def _max_model_len(config: dict[str, Any]) -> int:
    text_cfg = config.get("text_config") or {}
    value = text_cfg.get("max_position_embeddings", config.get("max_position_embeddings"))
    return int(value) if isinstance(value, int) and value > 0 else DEFAULT_MAX_MODEL_LEN


def _image_config(
    tokenizer: Tokenizer, config: dict[str, Any], pre: dict[str, Any]
) -> ImageConfig | None:
    vision = config.get("vision_config")
    token_id = config.get("image_token_index", config.get("image_token_id"))
    if not isinstance(vision, dict) or not isinstance(token_id, int):
        return None  # a text-only model
    token = tokenizer.id_to_token(token_id)
    if token is None:
        raise AssetError(f"config.json image_token_index {token_id} is not in the tokenizer")
    try:
        size, patch = int(vision["image_size"]), int(vision["patch_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise AssetError("config.json vision_config needs image_size and patch_size") from e
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise AssetError(f"unsupported vision_feature_select_strategy {strategy!r}")
    # "default" drops the CLS embedding; "full" keeps it as one more placeholder.
    count = (size // patch) ** 2 + (1 if strategy == "full" else 0)
    extra = {}
    if isinstance(pre.get("image_mean"), list):
        extra["image_mean"] = tuple(float(x) for x in pre["image_mean"])
    if isinstance(pre.get("image_std"), list):
        extra["image_std"] = tuple(float(x) for x in pre["image_std"])
    return ImageConfig(token_id, token, count, size, patch, **extra)
