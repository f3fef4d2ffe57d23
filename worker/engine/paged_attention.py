"""PagedAttentionContext: attention over K/V stored in fixed-size blocks.

KV cache layout: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]. A token at
position p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size.
Each forward step writes its new K/V into their slots, then every sequence gathers its whole
context through its block table and runs scaled_dot_product_attention (query i of a chunk that
starts at position c sees keys 0..c+i). Pure-decode batches take one padded SDPA call per layer.
Only portable tensor ops are used, so the same code runs on CPU and CUDA in any dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from worker.models.attention import causal_attention


@dataclass(slots=True)
class SeqSpan:
    """One sequence in a step: its queries are rows [q_start, q_start + num_q) of the batch."""

    q_start: int
    num_q: int
    context_len: int  # tokens computed before this step + num_q
    slots: Tensor  # [context_len] cache slots of positions 0..context_len-1


class PagedAttentionContext:
    def __init__(self, kv_cache: Tensor, slot_mapping: Tensor, spans: list[SeqSpan]) -> None:
        self.kv_cache = kv_cache
        self.slot_mapping = slot_mapping
        self.spans = spans
        self._decode_gather: Tensor | None = None
        self._decode_mask: Tensor | None = None
        if spans and all(s.num_q == 1 for s in spans):
            self._prepare_decode(kv_cache.device)

    def _prepare_decode(self, device: torch.device) -> None:
        longest = max(s.context_len for s in self.spans)
        gather = torch.zeros((len(self.spans), longest), dtype=torch.long, device=device)
        mask = torch.zeros((len(self.spans), 1, 1, longest), dtype=torch.bool, device=device)
        for row, span in enumerate(self.spans):
            gather[row, : span.context_len] = span.slots
            mask[row, 0, 0, : span.context_len] = True
        self._decode_gather, self._decode_mask = gather, mask

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        layer = self.kv_cache[layer_idx]
        k_cache = layer[0].view(-1, *layer.shape[-2:])
        v_cache = layer[1].view(-1, *layer.shape[-2:])
        k_cache.index_copy_(0, self.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, self.slot_mapping, v.to(v_cache.dtype))
        if self._decode_gather is not None:
            return self._attend_decode(q, k_cache, v_cache, scale)
        out = torch.empty_like(q)
        for span in self.spans:
            rows = slice(span.q_start, span.q_start + span.num_q)
            start = span.context_len - span.num_q
            if start == 0:  # nothing cached before this chunk: its own k/v are the context
                keys, values = k[rows], v[rows]
            else:
                keys, values = k_cache[span.slots], v_cache[span.slots]
            out[rows] = causal_attention(q[rows], keys, values, scale, q_start=start)
        return out

    def _attend_decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> Tensor:
        assert self._decode_gather is not None
        num_heads = q.shape[1]
        keys = k_cache[self._decode_gather].transpose(1, 2)  # [B, KV, L, D]
        values = v_cache[self._decode_gather].transpose(1, 2)
        group = num_heads // keys.shape[1]
        if group > 1:
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=self._decode_mask, scale=scale
        )
        return out.squeeze(2)
