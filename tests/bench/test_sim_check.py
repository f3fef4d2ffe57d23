"""`python -m bench.sim_check`: the GPU's end-to-end figures beside the calibrated sim's, in the
GPU's seconds, and each column's winner on both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bench_runs import run_bench
from tests.support.paths import REPO

pytestmark = pytest.mark.long


@pytest.mark.slow
def test_sim_figures_stand_beside_the_gpus_and_each_column_names_its_winners(tmp_path: Path):
    # Time scale 2: each sim step twice the GPU's, so the host's own milliseconds per request
    # (client, gateway, a busy CI host) weigh half as much once the times are scaled back.
    args = ["--only", "one-c1,hot", "--rounds", "1", "--sim-time-scale", "2"]
    summary = run_bench("sim_check", tmp_path / "check.json", *args, "--log-dir", str(tmp_path))
    rows = {(r["run"], r["policy"]): r for r in summary["rows"]}
    assert set(rows) == {("one-c1", "round_robin"), ("hot", "round_robin"), ("hot", "least_loaded")}
    # The H200's figures as gpu-figures.md gives them, the sim's measured beside them.
    assert (rows["hot", "least_loaded"]["gpu_rps"], rows["hot", "least_loaded"]["gpu_p50_ms"]) == (
        55.4,
        175,
    )
    for r in rows.values():
        for what in ("rps", "p50", "p90"):
            gpu = r[f"gpu_{what}" if what == "rps" else f"gpu_{what}_ms"]
            sim = r[f"sim_{what}" if what == "rps" else f"sim_{what}_ms"]
            assert sim > 0 and r[f"{what}_ratio"] == pytest.approx(sim / gpu)
    # One worker at one stream: the sim's first token, scaled back to the GPU's seconds, within
    # a factor of the GPU's (the fit holds its request time to 9%, and at one stream nothing
    # queues); a time left unscaled would read twice that.
    assert 0.5 < rows["one-c1", "round_robin"]["p50_ratio"] < 1.5
    # Every column of the hot run: the GPU's winner (least_loaded in all three), the sim's, and
    # the runner-up's margin over each.
    verdicts = {v["column"]: v for v in summary["shapes"]}
    assert set(verdicts) == {"req/s", "TTFT p50", "TTFT p90"}
    for v in verdicts.values():
        assert v["run"] == "hot" and v["gpu"] == "least_loaded"
        assert v["sim"] in ("round_robin", "least_loaded")
        assert v["same"] == (v["sim"] == "least_loaded")
        assert v["gpu_margin"] >= 1 and v["sim_margin"] >= 1


def test_an_unknown_run_is_refused_with_the_known_ones():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.sim_check", "--only", "hot,cold"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown runs cold; known: one-c1, one-c4, one-c16, hot, docs" in proc.stderr


@pytest.mark.slow
def test_a_gpu_runs_results_replace_the_reference_figures_policy_by_policy(tmp_path: Path):
    # What `bash bench/gpu.sh routing` leaves in $OUT is bench.ttft's JSON: one written here by
    # a small bench.ttft run stands in for the device's (the format, not the figures, is tested).
    results = tmp_path / "out"
    small = "--users-per-tenant 2 --tenants 2 --turns 2 --system-words 300 --concurrency 2"
    ttft = ["--engine", "sim", "--workers", "2", "--rounds", "1", *small.split()]
    ttft += ["--policies", "round_robin,cache_aware", "--log-dir", str(tmp_path / "ttft")]
    device = run_bench("ttft", results / "routing-hot.json", *ttft)
    args = ["--only", "one-c1,hot", "--rounds", "1", "--sim-time-scale", "2"]
    args += ["--gpu-results", str(results), "--log-dir", str(tmp_path / "check")]
    summary = run_bench("sim_check", tmp_path / "check.json", *args)
    assert summary["gpu_sources"] == {
        "one-c1": "gpu-figures.md",  # no routing-one-c1.json there
        "hot": str(results / "routing-hot.json"),
    }
    rows = {(r["run"], r["policy"]): r for r in summary["rows"]}
    assert set(rows) == {("one-c1", "round_robin"), ("hot", "round_robin"), ("hot", "cache_aware")}
    for m in device["medians"]:
        row = rows["hot", m["policy"]]
        assert (row["gpu_rps"], row["gpu_p50_ms"], row["gpu_p90_ms"]) == (
            m["requests_per_s"],
            m["ttft_p50_ms"],
            m["ttft_p90_ms"],
        )
        assert row["sim_rps"] > 0 and row["sim_p50_ms"] > 0  # the sim ran cache_aware too
    assert rows["one-c1", "round_robin"]["gpu_p50_ms"] == 58
    assert {v["column"] for v in summary["shapes"]} == {"req/s", "TTFT p50", "TTFT p90"}
    # Where the first tokens' time went: the device's run as its JSON gives it, the sim's of
    # every run beside it in the GPU's seconds.
    parts = {(p["run"], p["policy"], p["side"]): p for p in summary["first_token_parts"]}
    assert set(parts) == {
        ("one-c1", "round_robin", "sim"),
        *(
            ("hot", policy, side)
            for policy in ("round_robin", "cache_aware")
            for side in ("GPU", "sim")
        ),
    }
    for m in (p for p in device["first_token_parts"] if p["round"] == -1):
        row = parts["hot", m["policy"], "GPU"]
        assert [row[k] for k in ("client_ms", "to_engine_ms", "prefill_ms")] == [
            m[k] for k in ("client_ms", "to_engine_ms", "prefill_ms")
        ]
    assert all(p["client_ms"] > 0 and p["prefill_ms"] > 0 for p in parts.values())
    # The device's worker CPU per request, API servers and engine cores, as its JSON gives it.
    assert summary["gpu_host_cpu"] == [
        {
            "run": "hot",
            "policy": m["policy"],
            "server_cpu_ms": m["server_cpu_ms"],
            "core_cpu_ms": m["core_cpu_ms"],
        }
        for m in device["medians"]
    ]
    # bench.sim_refit reads the same JSON: its one evenly spread median (round_robin, 2 streams
    # over 2 workers) is one server figure, too few to fit three terms.
    proc = subprocess.run(
        [sys.executable, "-m", "bench.sim_refit", "--gpu-results", str(results)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "1 server figures in" in proc.stderr, proc.stderr
