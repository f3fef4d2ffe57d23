"""The GPU benchmark's ingredients on the CPU: random-weight shapes load identically in the engine
and in transformers (the comparison is on the same weights), and the suite runs end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from harness.random_llama import write_random_llama
from tests.support.bench_runs import run_bench
from worker.models.attention import DenseCausalContext
from worker.models.loader import load_model

pytestmark = pytest.mark.long


def test_random_shape_is_the_same_model_for_engine_and_transformers(tmp_path: Path) -> None:
    params = write_random_llama(tmp_path, "llama-tiny")
    ours = load_model(tmp_path, "cpu", "float32")
    assert sum(p.numel() for p in ours.parameters()) == params
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32)
    ids = torch.randint(100, 128000, (24,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, torch.arange(24), DenseCausalContext()))
    assert expected.abs().max() > 0
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_engine_bench_reports_every_figure(tmp_path: Path) -> None:
    args = ["--model", "llama-tiny", "--models-dir", str(tmp_path), "--reps", "1",
            "--new-tokens", "3", "--threads", "1", "--compare", "--long", "300"]  # fmt: skip
    figures = run_bench("engine", tmp_path / "engine.json", *args)["figures"]
    for name in (
        "engine_ttft_cold_2048_ms",
        "engine_ttft_hit90_2048_ms",
        "engine_decode_b1_ctx128_tok_s",
        "engine_decode_b8_ctx128_tok_s",
        "engine_decode_b16_shared2048_tok_s",
        "long_ttft_300_ms",
        "floor_decode_b1_tok_s",
        "floor_prefill_2048_ms",
        "hf_ttft_2048_ms",
        "hf_decode_b8_ctx128_tok_s",
    ):
        assert figures[name] > 0, name


def test_engine_ab_alternates_the_sides_and_reports_ratios(tmp_path: Path) -> None:
    args = ["--side", "torch:--elementwise-kernels=reference", "--side", "auto", "--rounds", "2",
            "--model", "llama-tiny", "--models-dir", str(tmp_path), "--reps", "1",
            "--new-tokens", "3", "--threads", "1"]  # fmt: skip
    result = run_bench("engine_ab", tmp_path / "ab.json", *args)
    # Each round runs every side, the order rotated: torch first, then auto first.
    assert [(r["round"], r["side"]) for r in result["runs"]] == [
        (1, "torch"), (1, "auto"), (2, "auto"), (2, "torch"),
    ]  # fmt: skip
    assert result["sides"][0]["args"] == ["--elementwise-kernels=reference"]
    for side in ("torch", "auto"):
        medians = result["medians"][side]
        rounds = [r["figures"] for r in result["runs"] if r["side"] == side]
        for name in ("engine_ttft_cold_2048_ms", "engine_decode_b8_ctx128_tok_s"):
            assert medians[name] > 0
            assert medians[name] == sum(f[name] for f in rounds) / 2  # median of two


def test_decode_profile_measures_both_modes_in_one_run(tmp_path: Path) -> None:
    """bench.decode_profile (bench/gpu.sh async) end to end on the CPU: every scenario, off and
    on, each round; GPU busy only where there is a GPU."""
    args = ["--model", "llama-tiny", "--models-dir", str(tmp_path), "--steps", "2",
            "--rounds", "2", "--threads", "1"]  # fmt: skip
    rows = run_bench("decode_profile", tmp_path / "profile.json", *args)["rows"]
    seen = {(r["round"], r["mode"], r["batch"], r["context"]) for r in rows}
    scenarios = {(1, 128), (64, 128), (16, 2048)}
    assert seen == {(r, m, *s) for r in (0, 1) for m in ("sync", "async") for s in scenarios}
    assert all(r["ms_per_step"] > 0 and r["gpu_busy"] is None for r in rows)
