"""`python -m bench.hit_rate` on a small workload: every policy runs on cold caches, its hit rate
agrees with the workers' own counters, and the upper bound is one worker with all the blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runs import run_bench

pytestmark = pytest.mark.long


@pytest.mark.slow
def test_hit_rate_runs_are_cold_and_counted_by_workers(tmp_path: Path):
    small = "--users-per-tenant 2 --turns 2 --system-words 600 --num-blocks 320 --concurrency 1"
    args = ["--replicas", "2", "--policies", "cache_aware,round_robin", *small.split()]
    summary = run_bench("hit_rate", tmp_path / "hit_rate.json", *args, "--log-dir", str(tmp_path))
    rows = {r["policy"]: r for r in summary["results"]}
    ca, rr, bound = rows["cache_aware"], rows["round_robin"], rows["upper_bound"]
    for r in (ca, rr, bound):
        assert r["failed"] == 0 and r["requests"] == 24
        # Every request reached a worker, and the workers' counters agree with the responses.
        assert sum(r["requests_per_replica"]) == 24
        assert r["worker_hit_rate"] == pytest.approx(r["hit_rate"], abs=1e-9)
    # round_robin alternates strictly; reset caches mean it did not inherit cache_aware's blocks.
    assert rr["requests_per_replica"] == [12, 12] and rr["max_over_mean"] == 1.0
    assert ca["hit_rate"] > rr["hit_rate"]
    assert bound["hit_rate"] >= ca["hit_rate"] * 0.9
    assert bound["blocks_per_replica"] == 640 and bound["max_over_mean"] is None
    ratio = summary["ratios"]["2"]["cache_aware_over_round_robin"]
    assert ratio == round(ca["hit_rate"] / rr["hit_rate"], 3)
