"""KV cache sizing from a profiled maximum-size step, measured on the CPU with real model steps."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from cachekey import Prompt
from tests.support.engine import make_engine
from worker.engine.memory import LiveTensorBytes, MemoryBudget, num_kv_blocks, step_peak_bytes
from worker.engine.sampling_params import SamplingParams


def test_live_tensor_bytes_counts_new_storages_only() -> None:
    weight = torch.ones(1000)
    with LiveTensorBytes() as meter:
        a = torch.empty(1000)  # 4000 B
        view = a[10:]  # same storage
        b = weight.t()  # a view of a foreign tensor: no new memory
        weight.add_(1)  # in place on a foreign tensor
        c = a * 2  # 4000 B more
        del a, view, c
        d = torch.empty(500)  # after 8000 B were freed
    assert meter.peak == 8000
    assert meter.live == 2000
    del b, d


def test_kv_blocks_from_budget() -> None:
    budget = MemoryBudget(total=1000, in_use=300, activation_peak=100, utilization=0.9)
    assert budget.kv_cache_bytes == 500
    assert num_kv_blocks(budget, 64) == 7
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        num_kv_blocks(MemoryBudget(1000, 850, 100, 0.9), 64)


def test_profile_grows_with_the_step_and_covers_its_tensors(demo_model_dir: Path) -> None:
    runner = make_engine(demo_model_dir).runner
    small = runner.profile_max_step(128, 8)
    large = runner.profile_max_step(1024, 8)
    cfg = runner.model.language_model.config
    gate_up = 1024 * 2 * cfg.intermediate_size * 4  # one float32 activation of the large step
    logits = 8 * runner.vocab_size * 4
    assert large > small > 0
    assert large >= gate_up + logits


def _step_peak(engine) -> int:
    """As the sizing measures a step: the allocator's peak on CUDA, live tensors elsewhere (on
    CUDA, torch 2.11 cannot build the lower-right causal mask under a dispatch mode)."""
    return step_peak_bytes(engine.step, engine.runner.device)


def test_profiled_peak_bounds_real_steps(demo_model_dir: Path) -> None:
    """The peak the sizing uses covers a real maximum-size fresh prefill and a maximum-size
    chunk after a long cached prefix (the prefix read-back term)."""
    chunk = 256
    engine = make_engine(
        demo_model_dir, max_num_batched_tokens=chunk, num_blocks=512, max_num_seqs=4
    )
    runner = engine.runner
    bound = runner.profile_peak(chunk, 4, engine.max_model_len)
    rng = random.Random(5)
    prompt = Prompt(tuple(rng.randrange(100, 1000) for _ in range(6 * chunk)))
    engine.add_request("long", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    peaks = []
    while engine.has_unfinished_requests():
        peaks.append(_step_peak(engine))
    assert len(peaks) == 6  # one fresh chunk, five after a growing prefix
    assert 0 < max(peaks) <= bound
