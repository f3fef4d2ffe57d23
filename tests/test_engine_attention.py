"""PagedAttentionContext against dense causal attention: chunks, prefixes, GQA, batched decode."""

from __future__ import annotations

import random

import pytest
import torch

from worker.engine.paged_attention import PagedAttentionContext, SeqSpan
from worker.models.attention import causal_attention

BS, LAYERS, HEADS, KV_HEADS, DIM, BLOCKS = 4, 2, 4, 2, 8, 64


def slots_of(table: list[int], n: int) -> torch.Tensor:
    t = torch.tensor(table)
    return (t[:, None] * BS + torch.arange(BS)).flatten()[:n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_paged_attention_equals_dense(dtype: torch.dtype) -> None:
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
    # Every sequence advances by a different chunk size each step; decode-like 1-token steps too.
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        spans, qs, ks, vs, slot_parts, owners = [], [], [], [], [], []
        row = 0
        for i, n in enumerate(lengths):
            if done[i] == n:
                continue
            step = min(n - done[i], rng.choice([1, 1, 3, 5, 9]))
            lo, hi = done[i], done[i] + step
            all_slots = slots_of(tables[i], hi)
            spans.append(SeqSpan(row, step, hi, all_slots))
            slot_parts.append(all_slots[lo:hi])
            qs.append(q_all[i][lo:hi])
            ks.append(k_all[i][lo:hi])
            vs.append(v_all[i][lo:hi])
            owners.append((i, step))
            row += step
            done[i] = hi
        ctx = PagedAttentionContext(kv, torch.cat(slot_parts), spans)
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        for layer in range(LAYERS):
            out = ctx.attend(layer, q, k, v, 0.3)
        for (i, step), span in zip(owners, spans, strict=True):
            got[i].append(out[span.q_start : span.q_start + step])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(len(lengths)):
        torch.testing.assert_close(torch.cat(got[i]), expected[i], atol=tol, rtol=tol)


def test_batched_decode_path_is_used_and_exact() -> None:
    torch.manual_seed(1)
    kv = torch.randn((1, 2, BLOCKS, BS, KV_HEADS, DIM))
    tables, lengths = [[5, 9, 2], [40], [7, 8]], [11, 3, 6]
    spans = [
        SeqSpan(i, 1, n, slots_of(t, n))
        for i, (t, n) in enumerate(zip(tables, lengths, strict=True))
    ]
    new_slots = torch.stack([s.slots[-1] for s in spans])
    ctx = PagedAttentionContext(kv, new_slots, spans)
    assert ctx._decode_gather is not None
    q = torch.randn(3, HEADS, DIM)
    k = torch.randn(3, KV_HEADS, DIM)
    v = torch.randn(3, KV_HEADS, DIM)
    out = ctx.attend(0, q, k, v, 0.5)
    flat_k, flat_v = kv[0, 0].view(-1, KV_HEADS, DIM), kv[0, 1].view(-1, KV_HEADS, DIM)
    for i, span in enumerate(spans):
        assert torch.equal(flat_k[span.slots[-1]], k[i])  # the new token was written in place
        ref = causal_attention(
            q[i : i + 1], flat_k[span.slots], flat_v[span.slots], 0.5, q_start=span.context_len - 1
        )
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)
