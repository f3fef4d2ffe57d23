"""Architecture name -> model class, and the ModelInfo the engine sizes its KV cache from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.models.llama import LlamaConfig, LlamaForCausalLM
from worker.models.llava import LlavaConfig, LlavaForConditionalGeneration

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
}

MODEL_TYPES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "llava": LlavaForConditionalGeneration,
}


def resolve_architecture(config: dict[str, Any]) -> type[nn.Module]:
    """The model class for a config.json dict (its `architectures`, else its `model_type`)."""
    for arch in config.get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    model_type = config.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ValueError(
        f"unsupported model: architectures={config.get('architectures')} "
        f"model_type={model_type!r}; "
        f"supported: {sorted(ARCHITECTURES)}"
    )


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engine needs to know about a model without touching its weights."""

    architecture: str
    is_multimodal: bool
    image_token_id: int | None
    tokens_per_image: int | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    sliding_window: int | None  # the engine attends over full context; it may reject these

    def kv_bytes_per_token(self) -> int:
        """K and V over all layers for one token."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def model_info(config: dict[str, Any], dtype: torch.dtype = torch.float32) -> ModelInfo:
    """ModelInfo from a config.json dict (validated the same way loading would)."""
    cls = resolve_architecture(config)
    if cls is LlavaForConditionalGeneration:
        llava = LlavaConfig.from_hf(config)
        text, image_token_id, tokens = llava.text, llava.image_token_id, llava.tokens_per_image
    else:
        text, image_token_id, tokens = LlamaConfig.from_hf(config), None, None
    return ModelInfo(
        architecture=cls.__name__,
        is_multimodal=image_token_id is not None,
        image_token_id=image_token_id,
        tokens_per_image=tokens,
        num_layers=text.num_hidden_layers,
        num_kv_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        dtype=dtype,
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        max_position_embeddings=text.max_position_embeddings,
        sliding_window=text.sliding_window,
    )
