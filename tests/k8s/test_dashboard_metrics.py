"""The dashboard, the docs and the live processes agree on the metrics: every metric the Grafana
dashboard queries exists on live gateway and worker processes, every panel metric the docs name is
queried by the dashboard, and docs/gateway.md's table lists exactly the metrics the gateway
exports."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.ports import free_port
from tests.support.paths import CHART, REPO

DASHBOARD = CHART / "dashboards" / "kvgate.json"
DOCS = REPO / "docs"
METRIC_NAME = re.compile(r"\b(?:vllm:[a-z0-9_:]+|kvgate_[a-z0-9_]+)\b")
# A family declared with # TYPE exposes these sample names even before its first labelled sample.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "summary": ("_sum", "_count", "_created", ""),
    "untyped": ("",),
}


def dashboard_metric_names() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    return {name for e in exprs for name in METRIC_NAME.findall(e)}


def section(doc: str, heading: str) -> str:
    """The text of one section of a docs page, up to the next heading of its level or above."""
    text = (DOCS / doc).read_text()
    start = text.index(heading + "\n")
    level = heading.split(" ", 1)[0]
    rest = text[start + len(heading) :]
    heading_re = re.compile(rf"^#{{1,{len(level)}}} ", re.MULTILINE)
    ends = [m.start() for m in heading_re.finditer(rest)]
    return rest[: ends[0]] if ends else rest


def documented(text: str) -> set[str]:
    """The metric names a docs table puts in backticks (comma-separated ones included)."""
    return {n for cell in re.findall(r"`([^`]+)`", text) for n in METRIC_NAME.findall(cell)}


def family(name: str) -> str:
    """A sample name without its histogram suffix (`x_bucket` -> `x`)."""
    return re.sub(r"_(bucket|sum|count)$", "", name)


def gateway_families(text: str) -> set[str]:
    """kvgate_* names as the docs write them: counters with `_total`, the rest by family."""
    out = set()
    for line in text.splitlines():
        if line.startswith("# TYPE kvgate_"):
            _, _, name, kind = line.split(maxsplit=3)
            if name.endswith("_created"):  # the creation time of a counter or histogram
                continue
            counter = kind == "counter" and not name.endswith("_total")
            out.add(name + "_total" if counter else name)
    return out


def exposed_names(text: str) -> set[str]:
    """Sample names in a Prometheus text exposition, plus the names its # TYPE lines promise."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            names |= {family + s for s in SUFFIXES.get(kind, ("",))}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def wait_ok(url: str, proc: subprocess.Popen, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not healthy in {deadline_s}s")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A sim worker on the demo model and a gateway routing to it; yields their base URLs."""
    env = {**os.environ, "KVGATE_CACHE_DIR": str(tmp_path / "cache")}
    wport, gport = free_port(), free_port()
    worker = [sys.executable, "-m", "worker", "--engine", "sim", "--model", "demo"]
    worker += ["--host", "127.0.0.1", "--port", str(wport)]
    worker += ["--kv-events-port", str(free_port()), "--kv-events-replay-port", str(free_port())]
    gateway = [sys.executable, "-m", "gateway", "--workers", f"http://127.0.0.1:{wport}"]
    gateway += ["--host", "127.0.0.1", "--port", str(gport)]
    procs: list[subprocess.Popen] = []
    try:
        for cmd in (worker, gateway):
            log = open(tmp_path / f"{cmd[2]}.log", "wb")  # noqa: SIM115 - closed with the process
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log))
        wait_ok(f"http://127.0.0.1:{wport}/health", procs[0])
        wait_ok(f"http://127.0.0.1:{gport}/health", procs[1])
        yield f"http://127.0.0.1:{wport}", f"http://127.0.0.1:{gport}"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_dashboard_metrics_exist_on_live_processes(cluster: tuple[str, str]) -> None:
    worker_url, gateway_url = cluster
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}],
        "max_tokens": 4,
    }
    deadline = time.monotonic() + 30
    while True:  # the gateway may need a poll cycle to see the worker healthy
        resp = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=30)
        if resp.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert resp.status_code == 200, resp.text

    exposed = exposed_names(httpx.get(f"{worker_url}/metrics", timeout=10).text)
    exposed |= exposed_names(httpx.get(f"{gateway_url}/metrics", timeout=10).text)
    wanted = dashboard_metric_names()
    assert len(wanted) >= 15
    missing = sorted(wanted - exposed)
    assert not missing, f"dashboard queries metrics nobody exports: {missing}"

    # docs/gateway.md's metrics table: every metric the gateway exports, and nothing else.
    families = gateway_families(httpx.get(f"{gateway_url}/metrics", timeout=10).text)
    table = documented(section("gateway.md", "## Metrics"))
    assert len(families) >= 20
    assert families - table == set(), "exported, not in docs/gateway.md's table"
    assert table - families == set(), "in docs/gateway.md's table, not exported"


def test_the_dashboard_shows_what_the_docs_say_it_shows() -> None:
    """docs/kubernetes.md's table of the dashboard's panels names only metrics it queries."""
    said = {family(n) for n in documented(section("kubernetes.md", "### 5. The dashboard"))}
    queried = {family(n) for n in dashboard_metric_names()}
    assert len(said) >= 15
    assert said - queried == set(), "docs/kubernetes.md names metrics the dashboard never plots"
    assert "kvgate_event_tail_gaps_total" in queried


def test_exposed_names_reads_types_and_samples() -> None:
    text = (
        "# HELP kvgate_requests Requests\n"
        "# TYPE kvgate_requests counter\n"
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="0.1"} 3.0\n'
        "vllm:num_requests_running 2.0\n"
    )
    names = exposed_names(text)
    assert "vllm:num_requests_running" in names
    assert "vllm:time_to_first_token_seconds_bucket" in names
    assert "kvgate_requests_total" in names  # declared, no labelled sample yet
    assert "kvgate_index_blocks" not in names
