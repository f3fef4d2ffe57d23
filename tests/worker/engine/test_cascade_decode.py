"""Shared-prefix (cascade) decode attention: its grouping, its result against softmax attention
written out, and an engine whose batched decode runs it giving each request's greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.engine import generate, make_engine, run_all, sampled_logits, tokens
from tests.worker.engine.test_paged_attention import naive_attention, slots_of
from worker.engine.cascade_decode import (
    MIN_SHARED_BLOCKS,
    CascadePlan,
    run_cascade,
    run_cascade_matmul,
    shared_prefixes,
)
from worker.engine.decode_attention import ReferenceDecode
from worker.engine.sampling_params import SamplingParams

BS, HEADS, KV_HEADS, DIM, BLOCKS = 4, 4, 2, 8, 96

# Two tenants' prefixes (blocks 10.. and 40..), a row diverging after 5 shared blocks, a row alone.
PREFIX_A = list(range(10, 17))
PREFIX_B = list(range(40, 46))
TABLES = [
    [*PREFIX_A, 70, 71],  # group A
    [*PREFIX_A, 72],  # group A, shorter
    [*PREFIX_A[:5], 73, 74, 75],  # shares only 5 blocks: drags group A's prefix to 5
    [*PREFIX_B, 76],  # group B
    [*PREFIX_B, 77, 78],  # group B
    [80, 81, 82, 83, 84, 85],  # alone
    [*PREFIX_B[:3], 86],  # too short to count: its full blocks are < MIN_SHARED_BLOCKS
]
LENGTHS = [35, 30, 29, 28, 32, 24, 13]


def test_groups_share_only_full_blocks_every_row_holds() -> None:
    width = max(len(t) for t in TABLES)
    tables = np.array([t + [0] * (width - len(t)) for t in TABLES])
    groups = shared_prefixes(tables, np.array(LENGTHS), BS)
    assert sorted((rows, n) for rows, n in groups) == [([0, 1, 2], 5), ([3, 4], 6)]
    # A row whose length ends a block keeps its newest token out of the shared prefix.
    exact = np.array([[*PREFIX_B, 76], [*PREFIX_B, 77]])
    assert shared_prefixes(exact, np.array([24, 28]), BS) == [([0, 1], 5)]
    assert MIN_SHARED_BLOCKS == 4


@pytest.mark.parametrize("run", [run_cascade, run_cascade_matmul], ids=["flash", "matmul"])
def test_cascade_equals_softmax_attention_written_out(run: Callable) -> None:
    """Both forms: the CPU flash kernel's, and the matmuls kept for a torch without it."""
    torch.manual_seed(3)
    kv = torch.randn((1, 2, BLOCKS, BS, KV_HEADS, DIM))
    width = max(len(t) for t in TABLES)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in TABLES])
    lens = torch.tensor(LENGTHS)
    kernel = ReferenceDecode()
    plan = kernel.plan(tables, lens, BS)
    assert isinstance(plan, CascadePlan) and len(plan.groups) == 2
    q = torch.randn(len(TABLES), HEADS, DIM)
    out = run(q, kv[0, 0], kv[0, 1], plan, 0.4)
    flat_k, flat_v = kv[0, 0].view(-1, KV_HEADS, DIM), kv[0, 1].view(-1, KV_HEADS, DIM)
    for i, (table, n) in enumerate(zip(TABLES, LENGTHS, strict=True)):
        slots = slots_of(table, n)
        ref = naive_attention(q[i : i + 1], flat_k[slots], flat_v[slots], 0.4, n - 1)
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)


def test_rows_sharing_nothing_keep_the_plain_gather() -> None:
    tables = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    plan = ReferenceDecode().plan(tables, torch.tensor([20, 20]), BS)
    assert not isinstance(plan, CascadePlan)


def test_batched_decode_over_a_shared_prompt_matches_each_alone(demo_model_dir: Path) -> None:
    """Eight requests of two 'tenants' decode in one batch through the cascade (and beside a
    ninth one's prefill) and give the tokens and logits each gives alone on an engine without
    prefix caching."""
    engine = make_engine(demo_model_dir, block_size=16)
    reference = make_engine(demo_model_dir, block_size=16, enable_prefix_caching=False)
    systems = [
        "You are a careful assistant for tenant alpha. " * 12,
        "Tenant beta's assistant answers briefly and exactly. " * 12,
    ]
    prompts = [
        engine.renderer.render_completion(systems[i % 2] + f"User {i} asks question {i * 7}.")
        for i in range(8)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    generate(engine, "warm-0", prompts[0], greedy)  # both tenants' prefixes are cached
    generate(engine, "warm-1", prompts[1], greedy)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy)
    first = {o.request_id: o for o in engine.step()}  # every prompt's tail: each row now decodes
    seqs = list(engine.scheduler.running)
    width = max(len(s.block_table) for s in seqs)
    tables = np.array([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])
    lens = np.array([s.num_tokens for s in seqs])
    assert len(shared_prefixes(tables, lens, 16)) == 2  # the decode steps run the cascade
    # A late request's prefill shares the next step with the eight decode rows (the mixed path).
    prompts.append(engine.renderer.render_completion(systems[0] + "A late user asks."))
    engine.add_request("r8", prompts[8], greedy)
    batched = run_all(engine)
    for i, p in enumerate(prompts):
        alone = generate(reference, f"alone-{i}", p, greedy)
        assert tokens([*([first[f"r{i}"]] if i < 8 else []), *batched[f"r{i}"]]) == tokens(alone)
        got = torch.stack(sampled_logits(engine, f"r{i}"))
        want = torch.stack(sampled_logits(reference, f"alone-{i}"))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
