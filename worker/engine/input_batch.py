"""Flatten one scheduled step into model inputs: ids, positions, slots, attention spans."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from worker.engine.paged_attention import PagedAttentionContext, SeqSpan
from worker.engine.scheduler import ScheduledSeq


@dataclass(slots=True)
class StepInputs:
    input_ids: Tensor  # [T]
    positions: Tensor  # [T]
    ctx: PagedAttentionContext
    # Row in the flattened batch of the last token of each sequence that samples this step.
    logits_rows: Tensor
    # Index into the scheduled batch of each sampling sequence, aligned with logits_rows.
    sampling: list[int]
    # Row in the flattened batch where each scheduled sequence's chunk starts.
    q_starts: list[int]


def prepare_inputs(
    batch: list[ScheduledSeq], block_size: int, kv_cache: Tensor, device: torch.device
) -> StepInputs:
    ids: list[int] = []
    positions: list[int] = []
    slot_parts: list[Tensor] = []
    spans: list[SeqSpan] = []
    logits_rows: list[int] = []
    sampling: list[int] = []
    q_starts: list[int] = []
    offsets = torch.arange(block_size)
    for index, item in enumerate(batch):
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        end = start + n
        q_start = len(ids)
        q_starts.append(q_start)
        ids += seq.token_ids[start:end]
        positions += range(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        slots = (table[:, None] * block_size + offsets).flatten()[:end]
        slot_parts.append(slots[start:end])
        spans.append(SeqSpan(q_start, n, end, slots.to(device)))
        if item.completes_prompt:
            logits_rows.append(len(ids) - 1)
            sampling.append(index)
    slot_mapping = torch.cat(slot_parts).to(device)
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        ctx=PagedAttentionContext(kv_cache, slot_mapping, spans),
        logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
        sampling=sampling,
        q_starts=q_starts,
    )
