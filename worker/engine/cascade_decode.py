"""Shared-prefix ("cascade") decode attention for the portable reference kernel.

Rows of a decode step whose block tables begin with the same physical blocks hold the same K/V
there: prefix caching hands every request of a tenant the blocks of its system prompt. The plain
reference gathers each row's whole context, so a step of B rows over a shared prefix of L tokens
reads B * L keys and values; that read, not the model's few matmuls, is what a CPU decode step
costs at batch 16 (docs/benchmarks.md, issue 35). Here each group of rows reads its common prefix
once and attends to it with all its queries stacked, every row attends alone to what follows its
group's prefix (its suffix), and the two partial softmaxes are merged by their log-sum-exp, as
vLLM's cascade attention does. The result equals the plain kernel's up to float rounding. Both
parts run in torch's CPU flash kernel, which reads the gathered K/V through strides and returns
the log-sum-exps (the matmul form built transposed copies and a softmax of its own: ~25% more
decode attention per request on issue 35's workload); the matmul form stays for a torch
without that kernel.

Grouping is host work over the block tables, so it is planned only where the tables already are
host memory (the CPU); on CUDA the reference stays the plain gather (Triton is the CUDA kernel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from worker.models.attention import FLASH_CPU as _FLASH_CPU

# A group must share at least this many full blocks: below it, the per-group calls cost more
# than the reads they save.
MIN_SHARED_BLOCKS = 4


@dataclass(slots=True)
class PrefixGroup:
    rows: Tensor  # [R] rows of the step sharing the prefix
    blocks: Tensor  # [n] the shared prefix's blocks


@dataclass(slots=True)
class CascadePlan:
    """Whole blocks are gathered, not slots: a block's K/V is one contiguous run of the cache."""

    groups: list[PrefixGroup]
    blocks: Tensor  # [B * W] each row's W suffix blocks (past its group's prefix), row-major
    mask: Tensor  # [B, 1, 1, W * block_size] the suffix positions a row sees
    bias: Tensor | None = None  # the mask as the flash kernel takes it (0 or -inf), made once


def shared_prefixes(tables: np.ndarray, lens: np.ndarray, block_size: int) -> list[tuple]:
    """(rows, blocks) per group of >= 2 rows sharing >= MIN_SHARED_BLOCKS leading blocks.

    Only blocks every row of the group has filled count (a block id shared in full is the same
    K/V), and each row keeps at least its current token outside the prefix."""
    full = (lens - 1) // block_size  # whole blocks before each row's newest token
    by_first: dict[int, list[int]] = {}
    for row in np.flatnonzero(full >= MIN_SHARED_BLOCKS):
        by_first.setdefault(int(tables[row, 0]), []).append(int(row))
    groups = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        limit = int(full[rows].min())
        same = (tables[rows, :limit] == tables[rows[0], :limit]).all(axis=0)
        shared = limit if same.all() else int(np.argmin(same))
        if shared >= MIN_SHARED_BLOCKS:
            groups.append((rows, shared))
    return groups


def plan_cascade(
    tables: Tensor, lens: Tensor, block_size: int, positions: Tensor
) -> CascadePlan | None:
    """The cascade plan of a step whose tables [B, P] and lens [B] are on the CPU; None when no
    rows share a prefix worth it. `positions` is an arange of at least P * block_size."""
    host_tables, host_lens = tables.numpy(), lens.numpy()
    found = shared_prefixes(host_tables, host_lens, block_size)
    if not found:
        return None
    skip = np.zeros(len(host_lens), dtype=np.int64)
    groups = []
    for rows, shared in found:
        skip[rows] = shared
        groups.append(PrefixGroup(torch.tensor(rows), tables[rows[0], :shared]))
    pages = -(-host_lens // block_size) - skip
    width = int(pages.max())
    columns = skip[:, None] + np.arange(width)
    columns = np.minimum(columns, host_tables.shape[1] - 1)  # past a row's pages: masked
    suffix = torch.from_numpy(np.take_along_axis(host_tables, columns, axis=1).ravel())
    seen = torch.from_numpy(host_lens - skip * block_size)
    mask = positions[None, : width * block_size] < seen[:, None]
    return CascadePlan(groups, suffix, mask.view(len(host_lens), 1, 1, -1))


def run_cascade(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: CascadePlan, scale: float
) -> Tensor:
    """q [B, H, D] over one layer's caches [num_blocks, block_size, KV, D] -> [B, H, D]."""
    if _FLASH_CPU is None:
        return run_cascade_matmul(q, k_cache, v_cache, plan, scale)
    batch, heads, dim = q.shape
    kv = k_cache.shape[2]
    # A KV head's query heads stand as that head's queries (no expanded keys); the flash kernel
    # reads the gathered keys through strides (no transposed copy) and gives the log-sum-exps.
    grouped = q.view(batch, kv, heads // kv, dim)
    keys = _blocks(k_cache, plan.blocks, batch)
    values = _blocks(v_cache, plan.blocks, batch)
    if plan.bias is None or plan.bias.dtype != q.dtype:
        plan.bias = torch.zeros(plan.mask.shape, dtype=q.dtype).masked_fill_(~plan.mask, -math.inf)
    out, lse = _FLASH_CPU(grouped, keys, values, attn_mask=plan.bias, scale=scale)
    for group in plan.groups:
        rows = group.rows
        num = rows.shape[0]
        stacked = grouped[rows].transpose(0, 1).reshape(1, kv, -1, dim)  # [1, KV, R * G, D]
        p_keys = _blocks(k_cache, group.blocks, 1)
        p_values = _blocks(v_cache, group.blocks, 1)
        p_out, p_lse = _FLASH_CPU(stacked, p_keys, p_values, scale=scale)
        p_out = p_out.view(kv, num, -1, dim).transpose(0, 1)
        p_lse = p_lse.view(kv, num, -1).transpose(0, 1)
        out[rows], lse[rows] = _merge(out[rows].float(), lse[rows], p_out.float(), p_lse)
    return out.reshape(batch, heads, dim).to(q.dtype)


def _blocks(cache: Tensor, blocks: Tensor, rows: int) -> Tensor:
    """The blocks' K or V as [rows, KV, L, D]: a strided view of one gathered copy."""
    kv, dim = cache.shape[-2:]
    return cache.index_select(0, blocks).view(rows, -1, kv, dim).transpose(1, 2)


def run_cascade_matmul(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: CascadePlan, scale: float
) -> Tensor:
    """run_cascade written with matmuls, for a torch without the CPU flash kernel."""
    batch, heads, dim = q.shape
    kv = k_cache.shape[2]
    grouped = q.float().view(batch, kv, heads // kv, dim)
    keys = _gather(k_cache, plan.blocks).view(batch, -1, kv, dim).transpose(1, 2)  # [B,KV,L,D]
    values = _gather(v_cache, plan.blocks).view(batch, -1, kv, dim).transpose(1, 2)
    scores = grouped @ keys.transpose(-1, -2) * scale  # [B, KV, G, L]
    scores = scores.masked_fill(~plan.mask, float("-inf"))
    out, lse = _softmax_attend(scores, values)
    for group in plan.groups:
        rows = group.rows
        num = rows.shape[0]
        # All the group's queries against the prefix read once: [KV, R * G, D].
        stacked = grouped[rows].permute(1, 0, 2, 3).reshape(kv, -1, dim)
        p_keys = _gather(k_cache, group.blocks).view(-1, kv, dim).permute(1, 2, 0)  # [KV,D,Lp]
        p_values = _gather(v_cache, group.blocks).view(-1, kv, dim).transpose(0, 1)
        p_out, p_lse = _softmax_attend(stacked @ p_keys * scale, p_values)
        p_out = p_out.view(kv, num, -1, dim).permute(1, 0, 2, 3)
        p_lse = p_lse.view(kv, num, -1).permute(1, 0, 2)
        out[rows], lse[rows] = _merge(out[rows], lse[rows], p_out, p_lse)
    return out.reshape(batch, heads, dim).to(q.dtype)


def _gather(cache: Tensor, blocks: Tensor) -> Tensor:
    return cache.index_select(0, blocks).float()


def _softmax_attend(scores: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """softmax(scores) @ values and the log-sum-exp of each row of scores."""
    top = scores.amax(-1, keepdim=True)
    weights = (scores - top).exp()
    total = weights.sum(-1, keepdim=True)
    out = (weights @ values) / total
    return out, (top + total.log()).squeeze(-1)


def _merge(a: Tensor, lse_a: Tensor, b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Two attentions over disjoint keys -> the attention over their union."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = a * (lse_a - lse).exp().unsqueeze(-1) + b * (lse_b - lse).exp().unsqueeze(-1)
    return out, lse
