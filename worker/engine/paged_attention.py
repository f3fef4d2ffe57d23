"""Attention contexts over K/V stored in fixed-size blocks.

KV cache layout: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]. A token at
position p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size.
Each forward step first writes its new K/V into their slots, then:

- a prefill chunk runs one SDPA call: over its own K/V when it starts at position 0, else over the
  K/V of positions 0..end read back from its slots, with the causal mask aligned to the end of the
  keys (query i of a chunk starting at c sees keys 0..c+i);
- one-token rows (decodes) run the decode kernel over their block tables in a single call.

`DecodeContext` is the pure-decode form whose tensors are all fixed buffers (see decode_runner),
so a step can be captured in a CUDA graph; `PagedAttentionContext` is the general eager form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from worker.engine.decode_attention import DecodeKernel
from worker.models.attention import causal_attention, chunk_after_prefix


def write_kv(kv_cache: Tensor, layer_idx: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
    layer = kv_cache[layer_idx]
    layer[0].view(-1, *layer.shape[-2:]).index_copy_(0, slots, k.to(layer.dtype))
    layer[1].view(-1, *layer.shape[-2:]).index_copy_(0, slots, v.to(layer.dtype))


@dataclass(slots=True)
class DecodeContext:
    """Every row is one token whose context is read through its block table; the kernel's plan
    of the tables is made once (`build`) and used by every layer."""

    kv_cache: Tensor
    slot_mapping: Tensor
    kernel: DecodeKernel
    plan: Any

    @classmethod
    def build(
        cls, kv_cache: Tensor, slots: Tensor, tables: Tensor, lens: Tensor, kernel: DecodeKernel
    ) -> DecodeContext:
        return cls(kv_cache, slots, kernel, kernel.plan(tables, lens, kv_cache.shape[3]))

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        write_kv(self.kv_cache, layer_idx, self.slot_mapping, k, v)
        layer = self.kv_cache[layer_idx]
        return self.kernel.run(q, layer[0], layer[1], self.plan, scale)


@dataclass(slots=True)
class PrefillSpan:
    """Rows [q_start, q_start + num_q) of the step are positions context_len - num_q.. of one
    sequence; `slots` holds the cache slots of positions 0..context_len-1 when the chunk
    continues a computed prefix (None when it starts at 0)."""

    q_start: int
    num_q: int
    context_len: int
    slots: Tensor | None


@dataclass(slots=True)
class DecodeRows:
    rows: Tensor  # [N] rows of the step that decode
    block_tables: Tensor  # [N, P]
    context_lens: Tensor  # [N]
    plan: object = None  # the kernel's, made on first use


class PagedAttentionContext:
    """A step with prefill chunks and possibly decode rows (eager: shapes vary per step)."""

    def __init__(
        self,
        kv_cache: Tensor,
        slot_mapping: Tensor,
        prefills: list[PrefillSpan],
        decodes: DecodeRows | None,
        kernel: DecodeKernel,
    ) -> None:
        self.kv_cache = kv_cache
        self.slot_mapping = slot_mapping
        self.prefills = prefills
        self.decodes = decodes
        self.kernel = kernel

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        write_kv(self.kv_cache, layer_idx, self.slot_mapping, k, v)
        layer = self.kv_cache[layer_idx]
        k_cache, v_cache = layer[0], layer[1]
        if len(self.prefills) == 1 and self.decodes is None and self.prefills[0].slots is None:
            return causal_attention(q, k, v, scale)  # one fresh prompt: no copy of the output
        out = q.new_empty(q.shape)
        flat_k = k_cache.view(-1, *k_cache.shape[-2:])
        flat_v = v_cache.view(-1, *v_cache.shape[-2:])
        for span in self.prefills:
            rows = slice(span.q_start, span.q_start + span.num_q)
            q_rows, k_rows, v_rows = q[rows], k[rows], v[rows]
            start = span.context_len - span.num_q
            if span.slots is None:
                out[rows] = causal_attention(q_rows, k_rows, v_rows, scale)
            elif q.device.type == "cpu":  # the prefix unmasked, the chunk causal (see there)
                prefix = span.slots[:start]
                p_k, p_v = flat_k.index_select(0, prefix), flat_v.index_select(0, prefix)
                out[rows] = chunk_after_prefix(q_rows, k_rows, v_rows, p_k, p_v, scale)
            else:  # CUDA's flash kernels take the lower-right mask without building it
                keys, values = flat_k[span.slots], flat_v[span.slots]
                out[rows] = causal_attention(q_rows, keys, values, scale, q_start=start)
        d = self.decodes
        if d is not None:
            if d.plan is None:
                d.plan = self.kernel.plan(d.block_tables, d.context_lens, k_cache.shape[1])
            out[d.rows] = self.kernel.run(q[d.rows], k_cache, v_cache, d.plan, scale)
        return out
