"""`bench.tier_routing` as its users run it: three fleets, every side every round in a turned
order, the host tier's hits and predictions reported per side."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runs import run_bench

pytestmark = pytest.mark.long


def test_three_sides_rotate_and_report_the_host_tier(tmp_path: Path) -> None:
    small = ["--workers", "2", "--num-blocks", "120", "--host-blocks", "1000", "--tenants", "4"]
    small += ["--users-per-tenant", "2", "--turns", "2", "--rounds", "2", "--concurrency", "4"]
    small += ["--sim-time-scale", "1", "--system-words", "300", "--log-dir", str(tmp_path)]
    out = run_bench("tier_routing", tmp_path / "tr.json", *small)
    rows = out["results"]
    assert [(r["side"], r["round"]) for r in rows] == [
        ("tier_aware", 0),
        ("tier_off", 0),
        ("ignore_tier", 0),
        ("tier_off", 1),
        ("ignore_tier", 1),
        ("tier_aware", 1),
    ]
    assert out["working_set_over_fleet_gpu"] > 1
    for r in rows:
        assert r["failed"] == 0
        if r["side"] == "tier_off":
            assert r["host_reported"] == 0 and r["host_hit"] == 0
        if r["side"] == "ignore_tier":
            assert r["host_predicted"] == 0  # blind to the tier: it predicts none
        if r["side"] == "tier_aware":
            assert r["host_predicted"] > 0 and r["host_reported"] > 0
    assert set(out["ttft_p50_ratios"]) == {"tier_off", "ignore_tier"}
