"""bench.async_mix end to end on a tiny closed loop: both sides serve it every round, the same
conversations, and the side with --async-scheduling launches steps ahead, admissions among them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runs import run_bench

pytestmark = pytest.mark.long


def test_async_mix_chains_admissions_with_the_same_answers(tmp_path: Path) -> None:
    # A wave's prompts (4 x 20 new tokens) overflow the 48-token budget: the requests fall out
    # of step, so some arrive while others decode.
    args = ["--rounds", "2", "--users", "6", "--turns", "2", "--concurrency", "4",
            "--system-tokens", "100", "--tail", "20", "--max-tokens", "6",
            "--num-blocks", "64", "--max-num-batched-tokens", "48"]  # fmt: skip
    result = run_bench("async_mix", tmp_path / "mix.json", *args)
    off, on = result["runs"]["off"], result["runs"]["on"]
    assert [r["round"] for r in off] == [r["round"] for r in on] == [0, 1]
    for run in on:  # most steps launched ahead, some of them admitting
        assert run["chained"] > run["calls"] // 2 and run["mixed"] > 0
        assert run["cpu_ms"] > 0 and run["forward_passes"] <= run["calls"]
    assert all("chained" not in run for run in off)
    assert result["medians"]["cpu_ms"]["off"] > 0
