"""The hidden-state benchmarks as their users run them: `bench.hidden_prefill`'s two engines return
the same embeddings, and `bench.embedding_routing` counts what the workers count."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runs import run_bench

pytestmark = pytest.mark.long


def test_prefill_compares_equal_embeddings(demo_model_dir: Path, tmp_path: Path) -> None:
    small = ["--prompts", "3", "--tokens", "300", "--rounds", "1", "--seed", "1"]
    out = run_bench("hidden_prefill", tmp_path / "hp.json", "--model", str(demo_model_dir), *small)
    rows = {r["workload"]: r for r in out["prefill"]}
    assert set(rows) == {"text", "images"} and rows["text"]["mean_tokens"] == 300
    assert all(r["prompts"] == 3 and r["max_abs_diff"] <= 1e-4 for r in rows.values())
    assert rows["text"]["hit_rate"] == pytest.approx(2 * 256 / 900)  # 16 full blocks, twice
    assert [r["figure"] for r in out["overhead"]] == [
        "prefill, 2,000 tokens",
        "decode step, batch 8",
    ]


def test_routing_run_counts_like_the_workers(tmp_path: Path) -> None:
    trace = ["--groups", "4", "--per-group", "3", "--prefix-words", "120", "--seed", "0"]
    cluster = ["--workers", "2", "--num-blocks", "256", "--log-dir", str(tmp_path)]
    args = [*trace, *cluster, "--policies", "cache_aware", "--concurrency", "1"]
    out = run_bench("embedding_routing", tmp_path / "er.json", *args)
    (row,) = out["rows"]
    assert row["requests"] == 12 and row["failed"] == 0
    assert row["exact_predictions"] == 1.0
    assert row["hit_rate"] > 0.5
    assert row["worker_hidden_hit_rate"] == pytest.approx(row["hit_rate"], abs=1e-9)
    assert 1.0 <= row["max_over_mean"] <= 2.0  # replicas counted by the name the header gives
