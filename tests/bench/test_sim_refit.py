"""`python -m bench.sim_refit`: the preset's worker-server cost refitted to a device run's
figures (bash bench/gpu.sh routing's JSONs)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support.paths import REPO
from worker.engine.sim_presets import H200_LLAMA_1B_SERVER, capacity_seconds, presets

# (run, workers, concurrency, {policy: prefix hit}): the workloads bench/gpu.sh routing runs.
RUNS = (
    ("one-c1", 1, 1, {"round_robin": 0.94}),
    ("one-c4", 1, 4, {"round_robin": 0.94}),
    ("one-c16", 1, 16, {"round_robin": 0.94}),
    ("hot", 4, 16, {"round_robin": 0.865, "least_loaded": 0.87, "cache_aware": 0.944}),
    ("docs", 4, 8, {"round_robin": 0.21, "least_loaded": 0.163, "cache_aware": 0.845}),
)


def write_runs(out: Path, worker, runs=RUNS) -> None:
    """bench.ttft's JSON of each run, its requests/s what `worker`'s step model gives (and
    cache_aware's nonsense, which the refit must leave out: its requests do not spread)."""
    out.mkdir()
    for run, workers, concurrency, hits in runs:
        medians = []
        for policy, hit in hits.items():
            seconds = capacity_seconds(worker, concurrency // workers, hit)
            rps = 1000.0 if policy == "cache_aware" else workers / seconds
            medians.append({"policy": policy, "round": -1, "hit_rate": hit, "requests_per_s": rps})
        args = {"workers": str(workers), "concurrency": str(concurrency)}
        (out / f"routing-{run}.json").write_text(json.dumps({"args": args, "medians": medians}))


def refit(results: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.sim_refit", "--gpu-results", str(results), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_refit_recovers_the_server_cost_its_figures_were_made_with(tmp_path: Path):
    # Today's worker, say: less per request, more per stream, less per uncached token.
    engine = presets()["h200-llama-1b"]
    worker = replace(engine, server_request=0.012, server_stream=0.005, server_token=8e-6)
    write_runs(tmp_path / "out", worker)
    proc = refit(tmp_path / "out", tmp_path / "refit.json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "refit.json").read_text())
    names = [f[0] for f in summary["figures"]]
    assert names == [
        "docs round_robin",
        "docs least_loaded",
        "hot round_robin",
        "hot least_loaded",
        "one-c1 round_robin",
        "one-c16 round_robin",
        "one-c4 round_robin",
    ]
    assert [f[1] for f in summary["figures"]] == [2, 2, 4, 4, 1, 16, 4]  # streams per worker
    for k in ("server_request", "server_stream", "server_token"):
        assert summary["refitted"][k] == pytest.approx(getattr(worker, k), rel=1e-3)
        assert summary["preset"][k] == pytest.approx(getattr(engine, k))
    for r in summary["residuals"]:
        assert r["refitted"] == pytest.approx(r["measured"], rel=1e-3)
    assert "server_request" in proc.stdout and "one-c16 round_robin" in proc.stdout


def test_the_presets_own_figures_give_the_preset_back(tmp_path: Path):
    """The 99afd2c runs the preset was fitted to, as bench.ttft's JSONs (one run each, one
    worker at their streams): the same coefficients and the same residuals."""
    out = tmp_path / "out"
    out.mkdir()
    for k, (_, streams, hit, seconds) in enumerate(H200_LLAMA_1B_SERVER):
        median = {"policy": "round_robin", "hit_rate": hit, "requests_per_s": 1 / seconds}
        data = {"args": {"workers": "1", "concurrency": str(streams)}, "medians": [median]}
        (out / f"routing-run{k}.json").write_text(json.dumps(data))
    proc = refit(out, tmp_path / "refit.json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "refit.json").read_text())
    assert len(summary["figures"]) == len(H200_LLAMA_1B_SERVER)
    for k in ("server_request", "server_stream", "server_token"):
        assert summary["refitted"][k] == pytest.approx(summary["preset"][k], rel=1e-6)
    for r in summary["residuals"]:
        assert r["refitted"] == pytest.approx(r["preset"], rel=1e-6)


def test_too_few_figures_is_said_plainly(tmp_path: Path):
    engine = presets()["h200-llama-1b"]
    write_runs(tmp_path / "out", engine, RUNS[3:4])  # hot alone: two figures for three terms
    proc = refit(tmp_path / "out", tmp_path / "refit.json")
    assert proc.returncode == 1
    assert "2 server figures in" in proc.stderr and "the fit needs at least 3" in proc.stderr
    assert not (tmp_path / "refit.json").exists()
