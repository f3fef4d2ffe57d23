"""Multi-LoRA for the Llama-family decoder: every token adds the update of its own adapter.

`LoRAModel` replaces each decoder layer's four projections (qkv, o, gate_up, down) with a
`LoRALinear`: the base projection plus, for a token whose adapter sits in slot s, (x A_s^T) B_s^T.
The A and B of all `max_loras` slots are stacked in one matrix per projection (ranks padded to
`max_lora_rank`, the scaling folded into B), so a batch mixing any adapters and the base model
runs two matmuls per projection, never one pass per adapter:

    shrink   xa = x @ [A_0^T | A_1^T | ...]          [T, slots * width]
    select   xa *= onehot(slot of each token)        each token keeps its own slot's columns
    expand   y += xa @ [B_0^T ; B_1^T ; ...]         [T, out]

This is what BGMV (punica) computes, each token's A and B picked by its slot, with fixed shapes
and no per-token copy of weights: the one-hot mask is built once per step from the tokens' slot
indices (a static input of the decode graphs) and shared by every projection. A merged projection
(q/k/v, gate/up) stacks its shards' A along the rank and places each shard's B on its own output
rows (block-diagonal), so it too is two matmuls. Rows of the base model have no slot: their mask
row is zero. A step with no adapter row skips the LoRA matmuls when it runs eagerly.
"""

from __future__ import annotations

import torch
from safetensors import safe_open
from torch import Tensor, nn

from worker.engine.lora_adapter import LoRAAdapter
from worker.models.layers import MergedLinear
from worker.models.llama import LlamaDecoderLayer

# Each decoder-layer projection we adapt: (sub-module, attribute) -> its checkpoint shard names.
_TARGETS = {
    ("self_attn", "qkv_proj"): None,  # a MergedLinear: q_proj, k_proj, v_proj
    ("self_attn", "o_proj"): ("o_proj",),
    ("mlp", "gate_up_proj"): None,  # gate_proj, up_proj
    ("mlp", "down_proj"): ("down_proj",),
}


class LoRABatch:
    """The per-step slot selection every LoRALinear reads: onehot [T, slots, 1] or None."""

    def __init__(self, max_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        self.slot_ids = torch.arange(max_loras, device=device)
        self.dtype = dtype
        self.onehot: Tensor | None = None

    def prepare(self, token_slots: Tensor) -> None:
        """token_slots: [T] int, each token's slot (-1: the base model)."""
        match = token_slots.unsqueeze(1) == self.slot_ids
        self.onehot = match.to(self.dtype).unsqueeze(-1)

    def clear(self) -> None:
        self.onehot = None


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Linear,
        shards: tuple[str, ...],
        shard_sizes: tuple[int, ...],
        batch: LoRABatch,
        max_loras: int,
        max_rank: int,
    ) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.shards = shards
        self.max_rank = max_rank
        self.num_slots = max_loras
        self.width = len(shards) * max_rank  # columns of one slot
        self.out_offsets = [sum(shard_sizes[:i]) for i in range(len(shards))]
        self.shard_sizes = shard_sizes
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        columns = max_loras * self.width
        self.register_buffer("lora_a", torch.zeros(base.in_features, columns, **like), False)
        self.register_buffer("lora_b", torch.zeros(columns, base.out_features, **like), False)

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        onehot = self.batch.onehot
        if onehot is None:
            return y
        t = x.shape[0]
        xa = torch.mm(x, self.lora_a).view(t, self.num_slots, self.width).mul_(onehot)
        return y.addmm_(xa.view(t, -1), self.lora_b)

    def set_slot(self, slot: int, weights: dict[str, tuple[Tensor, Tensor]]) -> None:
        """Write one adapter into `slot`: shard -> (A^T [in, r], scaled B^T [r, out])."""
        start = slot * self.width
        self.lora_a[:, start : start + self.width].zero_()
        self.lora_b[start : start + self.width].zero_()
        for i, shard in enumerate(self.shards):
            if shard not in weights:
                continue
            a_t, b_t = weights[shard]
            col = start + i * self.max_rank
            rank = a_t.shape[1]
            out = self.out_offsets[i]
            self.lora_a[:, col : col + rank].copy_(a_t)
            self.lora_b[col : col + rank, out : out + self.shard_sizes[i]].copy_(b_t)


class LoRAModel:
    """The LoRALinears of one model, the adapters' host weights, and the per-step selection.

    It is the LoRA manager's `LoRAWeights` (worker.engine.lora_manager).
    """

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        param = next(model.parameters())
        self.dtype = param.dtype
        self.device = param.device
        self.batch = LoRABatch(max_loras, self.dtype, self.device)
        # layer index -> the LoRALinears of that layer
        self.layers: dict[int, list[LoRALinear]] = {}
        for layer in model.modules():
            if isinstance(layer, LlamaDecoderLayer):
                self.layers[layer.self_attn.layer_idx] = self._wrap(layer, max_loras, max_rank)
        if not self.layers:
            raise ValueError("LoRA needs a Llama-family decoder; this model has none")
        self._host: dict[int, dict[tuple[int, str], tuple[Tensor, Tensor]]] = {}

    def _wrap(self, layer: nn.Module, max_loras: int, max_rank: int) -> list[LoRALinear]:
        wrapped = []
        for (sub, attr), shards in _TARGETS.items():
            parent = getattr(layer, sub)
            base = getattr(parent, attr)
            if isinstance(base, MergedLinear):
                names, sizes = base.shard_names, base.shard_sizes
            else:
                assert shards is not None
                names, sizes = shards, (base.out_features,)
            lora = LoRALinear(base, names, sizes, self.batch, max_loras, max_rank)
            setattr(parent, attr, lora)
            wrapped.append(lora)
        return wrapped

    def select(self, rows: list[tuple[int, int]]) -> None:
        """An eager step's rows, (slot, tokens) each: every token reads its row's slot."""
        if all(slot < 0 for slot, _ in rows):
            self.batch.clear()  # nothing to add: the base model alone
            return
        slot, count = torch.tensor(rows, dtype=torch.long).unbind(1)
        per_token = slot.repeat_interleave(count)
        self.batch.prepare(per_token.to(self.device, non_blocking=True))

    def load_lora(self, adapter: LoRAAdapter) -> None:
        """Read the adapter's matrices onto the host in the model's dtype, scaling folded in."""
        weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
        with safe_open(str(adapter.weights_file), framework="pt", device="cpu") as f:
            for module, (a_key, b_key) in adapter.modules.items():
                a = f.get_tensor(a_key).to(torch.float32)
                b = f.get_tensor(b_key).to(torch.float32) * adapter.scaling
                weights[module] = (a.t().to(self.dtype), b.t().to(self.dtype).contiguous())
        self._host[adapter.id] = weights

    def set_lora_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        host = self._host[adapter.id]
        for layer_idx, loras in self.layers.items():
            for lora in loras:
                shards = {s: host[(layer_idx, s)] for s in lora.shards if (layer_idx, s) in host}
                lora.set_slot(slot, shards)

    def drop_lora(self, adapter: LoRAAdapter) -> None:
        self._host.pop(adapter.id, None)
