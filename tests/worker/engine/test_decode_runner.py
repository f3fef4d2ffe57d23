"""DecodeRunner on the CPU: the fixed buffers and the bucket padding that CUDA graphs replay run
eagerly here, and must give what the unpadded step gives."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from cachekey import Prompt
from tests.support.engine import make_engine, run_all, sampled_logits, tokens
from worker.engine.decode_runner import batch_buckets
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams


def test_buckets_cover_every_batch_size() -> None:
    assert batch_buckets(64) == [1, 2, 4, *range(8, 65, 8)]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    engine_buckets = batch_buckets(32)
    for n in range(1, 33):
        assert min(b for b in engine_buckets if b >= n) >= n


def _count_decode_steps(engine: LLMEngine) -> list[tuple[int, int]]:
    """(live rows, rows run) of every step the DecodeRunner takes."""
    decoder = engine.runner.decoder
    seen: list[tuple[int, int]] = []
    run = decoder.run

    def counting_run(batch, feed=None):
        seen.append((len(batch), decoder.bucket(len(batch))))
        return run(batch, feed)

    decoder.run = counting_run
    return seen


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", Prompt(tuple(p)), params)
    return {rid: tokens(outs) for rid, outs in run_all(engine).items()}


def test_padded_decode_equals_unpadded(demo_model_dir: Path) -> None:
    rng = random.Random(3)
    # 5 live sequences pad to a bucket of 8; they finish at different steps, so 3, 2 and 1 live
    # rows run padded too. Prompt lengths cross block boundaries while decoding.
    prompts = [[rng.randrange(100, 1000) for _ in range(n)] for n in (9, 30, 16, 47, 3)]
    # Eager on CUDA too: this compares padding, not graphs (the other tests replay those there).
    plain = make_engine(demo_model_dir, max_num_seqs=8, enforce_eager=True)
    padded = make_engine(demo_model_dir, max_num_seqs=8, enforce_eager=True)
    padded.runner.decoder.buckets = batch_buckets(8)  # what CUDA graphs use, run eagerly
    plain_steps, padded_steps = _count_decode_steps(plain), _count_decode_steps(padded)
    expected = _generate(plain, prompts)
    got = _generate(padded, prompts)
    assert got == expected
    assert any(rows > live for live, rows in padded_steps)
    assert all(rows == live for live, rows in plain_steps) and plain_steps
    for rid in expected:
        for a, b in zip(sampled_logits(plain, rid), sampled_logits(padded, rid), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # Padding rows wrote only to the spare block past the scheduler's blocks.
    spare = padded.runner.num_blocks
    assert padded.runner.kv_cache[:, :, spare].abs().sum() > 0
    assert plain.runner.kv_cache[:, :, spare].abs().sum() == 0


def test_decode_steps_match_the_eager_path(demo_model_dir: Path) -> None:
    """Greedy tokens and logits through the DecodeRunner equal the general eager step's."""
    rng = random.Random(4)
    prompts = [[rng.randrange(100, 1000) for _ in range(n)] for n in (20, 33)]
    fast = make_engine(demo_model_dir)
    eager = make_engine(demo_model_dir)
    eager.runner._is_decode_step = lambda batch: False  # every step through prepare_inputs
    steps = _count_decode_steps(fast)
    expected = _generate(eager, prompts)
    assert _generate(fast, prompts) == expected
    assert steps  # the fast engine did decode through the runner
    for rid in expected:
        for a, b in zip(sampled_logits(eager, rid), sampled_logits(fast, rid), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
