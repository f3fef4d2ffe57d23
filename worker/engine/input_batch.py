"""Flatten one scheduled step into model inputs: ids, positions, slots, attention spans.

All integer inputs are computed on the host with numpy, packed, and sent in one copy (staging).
With --async-scheduling a row's one new token may not be known on the host yet: its id is taken
on the device from the step in flight's sampled tokens (a `Feed`, token_readback.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from worker.engine.decode_attention import DecodeKernel
from worker.engine.paged_attention import DecodeRows, PagedAttentionContext, PrefillSpan
from worker.engine.scheduler import ScheduledSeq
from worker.engine.staging import HostStager
from worker.engine.token_readback import Feed


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


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Cache slots of positions start..end-1 of a sequence with this block table."""
    table = np.asarray(block_table, dtype=np.int64)
    pos = np.arange(start, end, dtype=np.int64)
    return table[pos // block_size] * block_size + pos % block_size


class _Packer:
    """Collects int64 arrays; `unpack` cuts the staged device tensor back into them."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []

    def add(self, values: np.ndarray | list[int]) -> int:
        self.parts.append(np.asarray(values, dtype=np.int64).reshape(-1))
        return len(self.parts) - 1

    def stage(self, stager: HostStager) -> list[Tensor]:
        sizes = [p.shape[0] for p in self.parts]
        flat = stager.stage(np.concatenate(self.parts) if self.parts else np.zeros(0, np.int64))
        return list(flat.split(sizes))


@dataclass(slots=True)
class _Layout:
    """The host side of one step: every sequence's rows, flattened in batch order."""

    ids: list[int] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)
    slots: list[np.ndarray] = field(default_factory=list)
    spans: list[tuple[int, int, int, int | None]] = field(default_factory=list)  # + packed prefix
    decode_rows: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    sampling: list[int] = field(default_factory=list)
    q_starts: list[int] = field(default_factory=list)


def _lay_out(batch: list[ScheduledSeq], block_size: int, pack: _Packer) -> _Layout:
    out = _Layout()
    for index, item in enumerate(batch):
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        end = start + n
        q_start = len(out.ids)
        out.q_starts.append(q_start)
        ids = seq.token_ids[start:end]
        out.ids += ids if len(ids) == n else ids + [0] * (n - len(ids))  # 0: fed (`Feed`)
        out.positions.append(np.arange(start, end, dtype=np.int64))
        out.slots.append(slots_of(seq.block_table, start, end, block_size))
        if n == 1 and start > 0:
            out.decode_rows.append(q_start)
            out.decode_tables.append(seq.block_table[: -(-end // block_size)])
            out.decode_lens.append(end)
        else:
            prefix = pack.add(slots_of(seq.block_table, 0, end, block_size)) if start else None
            out.spans.append((q_start, n, end, prefix))
        if item.completes_prompt:
            out.logits_rows.append(len(out.ids) - 1)
            out.sampling.append(index)
    return out


def prepare_inputs(
    batch: list[ScheduledSeq],
    block_size: int,
    kv_cache: Tensor,
    stager: HostStager,
    kernel: DecodeKernel,
    feed: Feed | None = None,
) -> StepInputs:
    pack = _Packer()
    lay = _lay_out(batch, block_size, pack)
    fixed = [pack.add(lay.ids), pack.add(np.concatenate(lay.positions))]
    fixed += [pack.add(np.concatenate(lay.slots)), pack.add(lay.logits_rows)]
    fed = None
    if feed is not None:
        fed = pack.add([*(lay.q_starts[i] for i in feed.targets), *feed.rows])
    if lay.decode_rows:
        width = max(len(t) for t in lay.decode_tables)
        tables = np.zeros((len(lay.decode_tables), width), dtype=np.int64)
        for row, table in enumerate(lay.decode_tables):
            tables[row, : len(table)] = table
        fixed += [pack.add(lay.decode_rows), pack.add(tables), pack.add(lay.decode_lens)]
    staged = pack.stage(stager)
    input_ids, pos, slot_mapping, rows = (staged[i] for i in fixed[:4])
    if feed is not None and fed is not None:
        targets, sources = staged[fed].view(2, -1)
        input_ids.index_copy_(0, targets, feed.tokens[sources])
    decodes = None
    if lay.decode_rows:
        d_rows, d_tables, d_lens = (staged[i] for i in fixed[4:])
        decodes = DecodeRows(d_rows, d_tables.view(len(lay.decode_rows), -1), d_lens)
    prefills = [
        PrefillSpan(q, n, end, None if prefix is None else staged[prefix])
        for q, n, end, prefix in lay.spans
    ]
    return StepInputs(
        input_ids=input_ids,
        positions=pos,
        ctx=PagedAttentionContext(kv_cache, slot_mapping, prefills, decodes, kernel),
        logits_rows=rows,
        sampling=lay.sampling,
        q_starts=lay.q_starts,
    )
