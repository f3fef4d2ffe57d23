"""LLaVA-1.5-style multimodal model: CLIP tower -> feature layer(s) -> MLP projector -> Llama."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from worker.models.attention import AttentionContext
from worker.models.clip import ClipVisionConfig, ClipVisionModel
from worker.models.layers import get_activation
from worker.models.llama import LlamaConfig, LlamaForCausalLM


@dataclass(slots=True)
class LlavaConfig:
    text: LlamaConfig
    vision: ClipVisionConfig
    image_token_id: int
    feature_layers: tuple[int, ...]  # indices into the tower's hidden states, negatives allowed
    select_strategy: str  # "default" drops the CLS token, "full" keeps it
    projector_act: str
    projector_bias: bool

    def __post_init__(self) -> None:
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"unknown vision_feature_select_strategy {self.select_strategy!r}")
        num_states = self.vision.num_hidden_layers + 1
        for layer in self.feature_layers:
            if not -num_states <= layer < num_states:
                raise ValueError(f"vision_feature_layer {layer} outside the tower's {num_states}")
        get_activation(self.projector_act)

    @property
    def tokens_per_image(self) -> int:
        return self.vision.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def num_tower_layers_needed(self) -> int:
        num_states = self.vision.num_hidden_layers + 1
        return max(layer % num_states for layer in self.feature_layers)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> LlavaConfig:
        text = dict(config.get("text_config") or {})
        text.setdefault("model_type", "llama")
        layer = config.get("vision_feature_layer", -2)
        layers = (int(layer),) if isinstance(layer, int) else tuple(int(x) for x in layer)
        token_id = config.get("image_token_index", config.get("image_token_id", 32000))
        return cls(
            text=LlamaConfig.from_hf(text),
            vision=ClipVisionConfig.from_hf(dict(config.get("vision_config") or {})),
            image_token_id=int(token_id),
            feature_layers=layers,
            select_strategy=str(config.get("vision_feature_select_strategy", "default")),
            projector_act=str(config.get("projector_hidden_act", "gelu")),
            projector_bias=bool(config.get("multimodal_projector_bias", True)),
        )


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        in_features = config.vision.hidden_size * len(config.feature_layers)
        out_features = config.text.hidden_size
        self.linear_1 = nn.Linear(in_features, out_features, bias=config.projector_bias)
        self.act = get_activation(config.projector_act)
        self.linear_2 = nn.Linear(out_features, out_features, bias=config.projector_bias)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


def merge_embeddings(inputs_embeds: Tensor, is_placeholder: Tensor, image_embeds: Tensor) -> Tensor:
    """Put the rows of image_embeds [M, H], in order, at the M placeholder rows of inputs_embeds.

    `is_placeholder` is a bool mask [T]. A count mismatch is a caller bug (the ATOM #1358 crash
    was exactly this); raise a clear error instead of broadcasting or truncating.
    """
    num_slots = int(is_placeholder.sum())
    if num_slots != image_embeds.shape[0]:
        raise ValueError(
            f"{num_slots} image placeholder tokens but {image_embeds.shape[0]} image embedding rows"
        )
    if num_slots == 0:
        return inputs_embeds
    merged = inputs_embeds.clone()
    merged[is_placeholder] = image_embeds.to(merged.dtype)
    return merged


class LlavaForConditionalGeneration(nn.Module):
    """Module names follow the classic llava-hf checkpoint layout."""

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = ClipVisionModel(config.vision)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.language_model = LlamaForCausalLM(config.text)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> LlavaForConditionalGeneration:
        return cls(LlavaConfig.from_hf(config))

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    def encode_images(self, pixel_values: Tensor) -> Tensor:
        """pixel_values [N, 3, S, S] -> projected image embeddings [N, tokens_per_image, H]."""
        states = self.vision_tower(pixel_values, self.config.num_tower_layers_needed)
        # Index the (possibly truncated) state list with non-negative layer numbers.
        num_states = self.config.vision.num_hidden_layers + 1
        selected = [states[layer % num_states] for layer in self.config.feature_layers]
        if self.config.select_strategy == "default":
            selected = [s[:, 1:] for s in selected]
        features = selected[0] if len(selected) == 1 else torch.cat(selected, dim=-1)
        return self.multi_modal_projector(features)

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        return self.language_model.embed_tokens(input_ids)

    def embed_with_images(self, input_ids: Tensor, image_embeds: Tensor | None) -> Tensor:
        """Text embeddings with image_embeds [M, H] at the image placeholder tokens of input_ids."""
        is_placeholder = input_ids == self.config.image_token_id
        # The placeholder id may sit outside the text vocabulary; its row is overwritten anyway.
        embeds = self.embed_tokens(input_ids.masked_fill(is_placeholder, 0))
        if image_embeds is None:
            image_embeds = embeds.new_empty((0, embeds.shape[-1]))
        return merge_embeddings(embeds, is_placeholder, image_embeds)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        ctx: AttentionContext,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        if inputs_embeds is None:
            # Raises if input_ids hold placeholders: those need embed_with_images.
            inputs_embeds = self.embed_with_images(input_ids, None)
        return self.language_model(input_ids, positions, ctx, inputs_embeds)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.language_model.compute_logits(hidden)

    def tie_weights(self) -> None:
        self.language_model.tie_weights()
