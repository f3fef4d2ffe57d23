"""`python -m bench.ttft --engine sim` on a small workload: every worker is warmed before the
first measured policy, each round turns the policy order by one place, every round is reported,
the medians over the rounds come last, every request is written out, each run's mean first
token is split into where its time went, and the workers' CPU into their API servers' and their
engine cores'."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tests.support.bench_runs import run_bench

pytestmark = pytest.mark.long


@pytest.mark.slow
def test_ttft_sim_rounds_are_warmed_rotated_and_reported(tmp_path: Path):
    small = "--users-per-tenant 2 --tenants 2 --turns 2 --system-words 300 --concurrency 2"
    args = ["--engine", "sim", "--workers", "2", "--rounds", "2", *small.split()]
    args += ["--policies", "cache_aware,round_robin", "--log-dir", str(tmp_path)]
    summary = run_bench("ttft", tmp_path / "ttft.json", *args)
    rows = summary["results"]
    assert [(r["round"], r["policy"]) for r in rows] == [
        (0, "cache_aware"),
        (0, "round_robin"),
        (1, "round_robin"),
        (1, "cache_aware"),
    ]
    for r in rows:
        assert r["failed"] == 0 and r["requests"] == 8 and r["ttft_p50_ms"] > 0
        assert r["server_cpu_ms"] >= 0 and r["core_cpu_ms"] >= 0
    # The workers' CPU per request, split: their API servers and their engine cores both work
    # (read in clock ticks from /proc: summed over the runs, not one run's 8 requests).
    assert sum(r["server_cpu_ms"] for r in rows) > 0 and sum(r["core_cpu_ms"] for r in rows) > 0
    middle = {r["policy"]: r for r in summary["medians"]}
    for policy, row in middle.items():
        mine = [r["requests_per_s"] for r in rows if r["policy"] == policy]
        assert row["round"] == -1 and row["requests_per_s"] == statistics.median(mine)
        assert row["exact"].endswith("/16")
    assert summary["args"]["sim_preset"] == "h200-llama-1b"
    # Every request answered, each run's in the order sent, with where it went and its times.
    answered = summary["requests"]
    assert len(answered) == 4 * 8
    for k, r in enumerate(rows):
        run = answered[8 * k : 8 * (k + 1)]
        assert {(a["policy"], a["round"]) for a in run} == {(r["policy"], r["round"])}
        assert [a["sent_s"] for a in run] == sorted(a["sent_s"] for a in run)
        assert all(0 < a["ttft_s"] <= a["latency_s"] and a["replica"] for a in run)
    missed = [a for a in answered if a["predicted"] != a["reported"]]
    assert summary["mismatches"] == missed
    # Each run's mean first token in parts, from the client's timing and the workers' own
    # histograms: the client's is its requests' mean, each part is time spent (none negative:
    # each clock's interval lies within the one outside it), and the parts add up to it.
    parts = summary["first_token_parts"]
    assert [(p["round"], p["policy"]) for p in parts] == [
        *((r["round"], r["policy"]) for r in rows),
        (-1, "cache_aware"),
        (-1, "round_robin"),
    ]
    for k, p in enumerate(parts[:4]):
        mean = statistics.fmean(a["ttft_s"] for a in answered[8 * k : 8 * (k + 1)]) * 1e3
        assert p["client_ms"] == pytest.approx(mean, abs=0.1)
        pieces = [p[f] for f in ("to_worker_ms", "to_engine_ms", "queue_ms", "prefill_ms")]
        assert min(pieces) >= 0 and p["prefill_ms"] > 0
        assert sum(pieces) == pytest.approx(p["client_ms"], abs=0.3)
