"""bench.worker_ab end to end on a tiny workload: both trees' clusters serve every concurrency in
every round, the order rotating, and each run carries its rates and CPU per request."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runs import run_bench
from tests.support.paths import REPO

pytestmark = pytest.mark.long


def test_worker_ab_rotates_the_trees_and_reports_cpu_per_request(tmp_path: Path) -> None:
    args = ["--baseline", str(REPO), "--concurrency", "1,2", "--rounds", "2",
            "--users-per-tenant", "1", "--turns", "1", "--system-words", "40",
            "--max-tokens", "2", "--num-blocks", "64"]  # fmt: skip
    result = run_bench("worker_ab", tmp_path / "ab.json", *args)
    order = [(r["round"], r["concurrency"], r["tree"]) for r in result["runs"]]
    this, base = "this tree", "baseline"
    assert order == [
        (0, 1, this), (0, 1, base), (0, 2, base), (0, 2, this),
        (1, 1, base), (1, 1, this), (1, 2, this), (1, 2, base),
    ]  # fmt: skip
    for run in result["runs"]:
        assert run["requests"] == 2 and run["failed"] == 0  # 2 tenants x 1 user x 1 turn
        assert run["req_s"] > 0 and run["worker_cpu_ms_per_req"] > 0
        assert run["gateway_cpu_ms_per_req"] >= 0
    for tree in (this, base):
        assert result["medians"][tree]["1"]["req_s_vs_first"] == 1.0
