"""Paged attention against dense causal attention: chunks, prefixes, GQA, batched decode (the
Triton decode kernel against the reference: tests/worker/engine/test_triton_decode.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from worker.engine.decode_attention import (
    ReferenceDecode,
    select_decode_kernel,
)
from worker.engine.paged_attention import (
    DecodeContext,
    DecodeRows,
    PagedAttentionContext,
    PrefillSpan,
)
from worker.models.attention import causal_attention, chunk_after_prefix

BS, LAYERS, HEADS, KV_HEADS, DIM, BLOCKS = 4, 2, 4, 2, 8, 64


def slots_of(table: list[int], n: int) -> torch.Tensor:
    t = torch.tensor(table)
    return (t[:, None] * BS + torch.arange(BS)).flatten()[:n]


def naive_attention(q, k, v, scale: float, q_start: int) -> torch.Tensor:
    """Softmax attention written out in float64 (no SDPA), GQA by head index."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    pos_q = torch.arange(q_start, q_start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos_q, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


@pytest.mark.parametrize("q_start", [0, 5, 17])
def test_causal_attention_aligns_the_mask_to_the_end_of_the_keys(q_start: int) -> None:
    torch.manual_seed(q_start)
    q = torch.randn(6, HEADS, DIM)
    k = torch.randn(q_start + 6, KV_HEADS, DIM)
    v = torch.randn(q_start + 6, KV_HEADS, DIM)
    got = causal_attention(q, k, v, 0.4, q_start=q_start)
    torch.testing.assert_close(got, naive_attention(q, k, v, 0.4, q_start), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("prefix", "chunk", "dtype"),
    [
        (1, 1, torch.float32),
        (37, 9, torch.float32),
        (300, 64, torch.float32),
        (40, 16, torch.bfloat16),
    ],
)
def test_chunk_after_prefix_equals_causal_attention_over_both(
    prefix: int, chunk: int, dtype: torch.dtype
) -> None:
    """The CPU's two unmasked calls merged by log-sum-exp against the softmax written out."""
    torch.manual_seed(prefix + chunk)
    q = torch.randn(chunk, HEADS, DIM, dtype=dtype)
    k = torch.randn(prefix + chunk, KV_HEADS, DIM, dtype=dtype)
    v = torch.randn(prefix + chunk, KV_HEADS, DIM, dtype=dtype)
    got = chunk_after_prefix(q, k[prefix:], v[prefix:], k[:prefix], v[:prefix], 0.4)
    assert got.shape == q.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want = naive_attention(q, k, v, 0.4, prefix)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_causal_attention_rejects_mismatched_keys() -> None:
    with pytest.raises(ValueError, match="cannot serve"):
        causal_attention(torch.zeros(3, 4, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), 1.0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_paged_attention_equals_dense(dtype: torch.dtype) -> None:
    """Mixed steps: prefill chunks (fresh and after a prefix) and one-token rows side by side."""
    rng = random.Random(0)
    torch.manual_seed(0)
    lengths = [13, 7, 22]
    free = list(range(BLOCKS))
    rng.shuffle(free)  # block tables are scattered, not contiguous
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lengths]
    q_all = [torch.randn(n, HEADS, DIM, dtype=dtype) for n in lengths]
    k_all = [torch.randn(n, KV_HEADS, DIM, dtype=dtype) for n in lengths]
    v_all = [torch.randn(n, KV_HEADS, DIM, dtype=dtype) for n in lengths]
    expected = [causal_attention(q, k, v, 0.3) for q, k, v in zip(q_all, k_all, v_all, strict=True)]
    kv = torch.zeros((LAYERS, 2, BLOCKS, BS, KV_HEADS, DIM), dtype=dtype)
    done = [0, 0, 0]
    got: list[list[torch.Tensor]] = [[], [], []]
    saw_mixed = False
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        spans, qs, ks, vs, slot_parts, owners = [], [], [], [], [], []
        d_rows, d_tables, d_lens = [], [], []
        row = 0
        for i, n in enumerate(lengths):
            if done[i] == n:
                continue
            step = min(n - done[i], rng.choice([1, 1, 3, 5, 9]))
            lo, hi = done[i], done[i] + step
            all_slots = slots_of(tables[i], hi)
            if step == 1 and lo > 0:
                d_rows.append(row)
                d_tables.append(tables[i])
                d_lens.append(hi)
            else:
                spans.append(PrefillSpan(row, step, hi, all_slots if lo else None))
            slot_parts.append(all_slots[lo:hi])
            qs.append(q_all[i][lo:hi])
            ks.append(k_all[i][lo:hi])
            vs.append(v_all[i][lo:hi])
            owners.append((i, row, step))
            row += step
            done[i] = hi
        decodes = None
        if d_rows:
            width = max(len(t) for t in d_tables)
            padded = torch.tensor([t + [0] * (width - len(t)) for t in d_tables])
            decodes = DecodeRows(torch.tensor(d_rows), padded, torch.tensor(d_lens))
            saw_mixed |= bool(spans)
        ctx = PagedAttentionContext(kv, torch.cat(slot_parts), spans, decodes, ReferenceDecode())
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        for layer in range(LAYERS):
            out = ctx.attend(layer, q, k, v, 0.3)
        for i, start, step in owners:
            got[i].append(out[start : start + step])
    assert saw_mixed  # the schedule above did mix prefill chunks and decode rows in one step
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(len(lengths)):
        torch.testing.assert_close(torch.cat(got[i]), expected[i], atol=tol, rtol=tol)


def test_decode_context_writes_in_place_and_attends_through_tables() -> None:
    torch.manual_seed(1)
    kv = torch.randn((1, 2, BLOCKS, BS, KV_HEADS, DIM))
    tables, lengths = [[5, 9, 2], [40, 0, 0], [7, 8, 0]], [11, 3, 6]
    last = torch.stack([slots_of(t, n)[-1] for t, n in zip(tables, lengths, strict=True)])
    ctx = DecodeContext.build(
        kv, last, torch.tensor(tables), torch.tensor(lengths), ReferenceDecode()
    )
    q = torch.randn(3, HEADS, DIM)
    k = torch.randn(3, KV_HEADS, DIM)
    v = torch.randn(3, KV_HEADS, DIM)
    out = ctx.attend(0, q, k, v, 0.5)
    flat_k, flat_v = kv[0, 0].view(-1, KV_HEADS, DIM), kv[0, 1].view(-1, KV_HEADS, DIM)
    for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        slots = slots_of(table, n)
        assert torch.equal(flat_k[slots[-1]], k[i])  # the new token was written in place
        ref = naive_attention(q[i : i + 1], flat_k[slots], flat_v[slots], 0.5, n - 1)
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)


def test_reference_is_the_choice_on_cpu() -> None:
    kernel = select_decode_kernel("auto", torch.device("cpu"), 16, 64, 8)
    assert isinstance(kernel, ReferenceDecode) and kernel.name == "reference"
    with pytest.raises(ValueError, match="decode attention must be one of"):
        select_decode_kernel("flash", torch.device("cpu"), 16, 64, 8)


def test_triton_on_cpu_is_refused_outside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA"):
        select_decode_kernel("triton", torch.device("cpu"), 16, 64, 8)
