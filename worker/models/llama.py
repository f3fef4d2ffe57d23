"""Llama-family decoder: Llama, Mistral and Qwen2 (GQA, RoPE with scaling, RMSNorm, SwiGLU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from worker.models.attention import AttentionContext
from worker.models.layers import Embedding, GatedActivation, MergedLinear, RMSNorm
from worker.models.rotary import RotaryEmbedding

# Fields a config.json may omit, per model_type (the transformers defaults for each family).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "max_position_embeddings": 2048, "attention_bias": False},
    "mistral": {"vocab_size": 32000, "max_position_embeddings": 4096 * 32, "attention_bias": False},
    "qwen2": {"vocab_size": 151936, "max_position_embeddings": 32768, "attention_bias": True},
}


@dataclass(slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    raw: dict[str, Any]  # the config.json dict, for the rotary settings

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> LlamaConfig:
        model_type = config.get("model_type", "llama")
        if model_type not in _DEFAULTS:
            raise ValueError(f"not a Llama-family model_type: {model_type!r}")
        cfg = {**_DEFAULTS[model_type], **config}
        hidden = int(cfg.get("hidden_size", 4096))
        heads = int(cfg.get("num_attention_heads", 32))
        bias = bool(cfg["attention_bias"])
        # Qwen2 has q/k/v bias but no o_proj bias; Llama's attention_bias covers all four.
        o_bias = bias and model_type != "qwen2"
        sliding = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 11008)),
            num_hidden_layers=int(cfg.get("num_hidden_layers", 32)),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            qkv_bias=bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=int(sliding) if sliding else None,
            raw=config,
        )


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            ("q_proj", "k_proj", "v_proj"),
            (q_size, kv_size, kv_size),
            bias=config.qkv_bias,
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.split_sizes = [q_size, kv_size, kv_size]

    def forward(
        self, positions: Tensor, hidden: Tensor, rotary: RotaryEmbedding, ctx: AttentionContext
    ) -> Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = ctx.attend(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(
            config.hidden_size, ("gate_proj", "up_proj"), (inter, inter), bias=config.mlp_bias
        )
        self.act = GatedActivation(config.hidden_act)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: Tensor, hidden: Tensor, rotary: RotaryEmbedding, ctx: AttentionContext
    ) -> Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), rotary, ctx)
        # The residual add and the MLP's norm in one pass when fused. The layer still takes and
        # returns the whole residual stream (the hidden-state cache hooks read it there), so
        # the MLP's add stays apart from the next layer's norm.
        hidden, normed = self.post_attention_layernorm.add_forward(hidden, attn)
        return hidden + self.mlp(normed)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.from_config(
            config.raw, config.head_dim, config.max_position_embeddings
        )

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        ctx: AttentionContext,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            hidden = layer(positions, hidden, self.rotary_emb, ctx)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Flattened-token decoder: forward takes the T tokens of a step, returns hidden [T, H]."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> LlamaForCausalLM:
        return cls(LlamaConfig.from_hf(config))

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        ctx: AttentionContext,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        return self.model(input_ids, positions, ctx, inputs_embeds)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def tie_weights(self) -> None:
        """Re-share lm_head with the embedding (after `to_empty`, which un-shares parameters)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def ignored_checkpoint_weight(name: str, config: LlamaConfig) -> bool:
    """Checkpoint tensors with no parameter here that are safe to skip."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    # Tied checkpoints sometimes still carry a copy of the embedding as lm_head.
    return config.tie_word_embeddings and name.endswith("lm_head.weight")
