"""`bench.host_tier` as its users run it: every round times a cold prefill, a GPU-tier hit and a
host-tier hit whose cached tokens the script itself checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runs import run_bench

pytestmark = pytest.mark.long


def test_rounds_time_all_three_and_rotate(demo_model_dir: Path, tmp_path: Path) -> None:
    small = ["--tokens", "256", "--rounds", "2", "--num-blocks", "40", "--kv-offload-blocks", "64"]
    out = run_bench("host_tier", tmp_path / "ht.json", "--model", str(demo_model_dir), *small)
    rows = out["rounds"]
    assert [r["round"] for r in rows] == [0, 1]
    for row in rows:
        assert row["fillers"] >= 1
        assert all(row[k] > 0 for k in ("cold_ms", "gpu_hit_ms", "host_hit_ms"))
    assert out["summary"]["host_over_cold"] > 0
