"""The engine core in a process of its own: a SIGKILL'd core turns /health red and fails every
pending request with a 5xx at once, seen through a pidfd or, where Python has no
os.pidfd_open (macOS, Linux before 5.3), by polling; the core stops with the worker and when the
API server dies (no process is left behind); a core that cannot load ends its worker with its
message."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from harness.ports import free_port
from harness.proc import Proc
from harness.waits import wait_until
from tests.support.paths import REPO
from tests.support.processes import alive, children, wait_dead
from tests.support.worker_harness import WorkerProcess

SLOW = ("--sim-decode-s-per-step", "0.02")
LONG = {"model": "demo", "prompt": "tell me a long story", "max_tokens": 3000, "ignore_eos": True}


def _core_pid(w: WorkerProcess) -> int:
    assert w.proc is not None
    (pid,) = children(w.proc.pid)  # one engine: one core process, and nothing else
    return pid


def _running(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:num_requests_running not exported")


def _in_background(
    url: str, stream: bool, body: dict | None = None
) -> tuple[threading.Thread, dict]:
    result: dict = {"lines": []}

    def run() -> None:
        body_sent = {**(body or LONG), "stream": stream}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body_sent, timeout=30) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if line:
                        result["lines"].append(line)
        except httpx.HTTPError as e:  # the API server itself was killed
            result["error"] = e
        result["done_at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


@pytest.fixture(params=["pidfd", "no_pidfd"])
def platform_env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """The worker's environment: this host's, or one whose Python has no os.pidfd_open."""
    if request.param == "pidfd":
        return {}
    (tmp_path / "sitecustomize.py").write_text("import os\n\ndel os.pidfd_open\n")
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    }


def test_killed_core_fails_pending_requests_and_health_at_once(demo_model_dir, platform_env):
    with WorkerProcess(demo_model_dir, *SLOW, events=False, env=platform_env) as w:
        core = _core_pid(w)
        streamed, s = _in_background(w.url, stream=True)
        whole, p = _in_background(w.url, stream=False)
        wait_until(lambda: _running(w.url) == 2, 10)
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        took = wait_until(lambda: httpx.get(w.url + "/health").status_code == 503, 5)
        assert took < 2
        health = httpx.get(w.url + "/health").json()
        assert "engine core process exited" in health["error"]["message"]
        for t in (streamed, whole):
            t.join(10)
            assert not t.is_alive()
        # The stream had its 200: it ends with an in-band error event, then [DONE].
        assert s["status"] == 200 and s["done_at"] - killed < 2
        # Both were in the engine when it died: `engine_died` (gateway/quarantine.py).
        assert '"engine_died"' in s["lines"][-2] and "engine core process" in s["lines"][-2]
        assert s["lines"][-1] == "data: [DONE]"
        # The whole answer had not started: a 503 with an OpenAI error body.
        assert p["status"] == 503 and p["done_at"] - killed < 2
        assert '"engine_died"' in p["lines"][0]
        # New requests are refused at once, with a clear 503; the server itself answers.
        t0 = time.monotonic()
        r = httpx.post(w.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and time.monotonic() - t0 < 1.0
        assert r.json()["error"]["code"] == "engine_dead"
        assert httpx.get(w.url + "/kv/snapshot").status_code == 503
        assert httpx.get(w.url + "/kvgate/info").status_code == 200
        assert w.proc is not None and w.proc.poll() is None  # the API server lives on
    assert not alive(core)


def test_core_stops_with_the_worker(demo_model_dir):
    w = WorkerProcess(demo_model_dir, events=False).start()
    try:
        core = _core_pid(w)
        r = httpx.post(w.url + "/v1/completions", json={**LONG, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert w.proc is not None
        w.proc.terminate()  # SIGTERM: the lifespan stops the core
        w.proc.wait(15)
        assert wait_dead(core, 10)
        # An orderly stop: the core took Shutdown, not the end of its stdin.
        assert "API server is gone" not in w.log(), w.log()[-2000:]
    finally:
        w.stop()


def test_core_exits_when_the_api_server_is_killed(demo_model_dir):
    w = WorkerProcess(demo_model_dir, *SLOW, events=False).start()
    try:
        core = _core_pid(w)
        streamed, streamed_result = _in_background(w.url, stream=True)
        wait_until(lambda: _running(w.url) == 1, 10)
        assert w.proc is not None
        w.proc.kill()  # no lifespan, no shutdown message: only the closed pipe tells the core
        w.proc.wait(5)
        assert wait_dead(core, 10), "the engine core outlived its API server"
        streamed.join(10)
        assert isinstance(streamed_result["error"], httpx.RemoteProtocolError)
    finally:
        w.stop()


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds `marker` (this user's, from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_core_that_cannot_load_ends_the_worker_with_its_message(demo_model_dir, tmp_path):
    """The API server imports its web stack while its cores load; a core that fails (here a
    checkpoint cut short) ends the worker with exit status 2 and the core's own message, and
    leaves no process behind."""
    model = tmp_path / "model"
    shutil.copytree(demo_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    marker = f"KVGATE_TEST_MARK={uuid.uuid4().hex}"
    env = dict(os.environ, **dict([marker.split("=")]))
    argv = [sys.executable, "-m", "worker", "--model", str(model), "--port", "0"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: {weights} is not a readable safetensors file" in proc.stderr
    assert "Traceback" not in proc.stderr
    wait_until(lambda: not _processes_with(marker), 10, "the core to end with its worker")


def test_a_sigterm_to_the_whole_process_group_drains_like_one_to_the_worker(
    demo_model_dir, tmp_path
):
    """systemd's default stop (and `kill -- -PGID`) sends SIGTERM to every process of the
    worker, its engine core too: the core leaves stopping to the API server, so a stream in
    flight finishes as in a drain instead of ending with the core's death."""
    port = free_port()
    args = ["-m", "worker", "--model", str(demo_model_dir), "--served-model-name", "demo",
            "--engine", "sim", "--port", str(port), "--kv-events-port", str(free_port()),
            "--kv-events-replay-port", str(free_port()), *SLOW]  # fmt: skip
    w = Proc("worker", args, port, tmp_path / "worker.log")  # a session of its own
    w.start()
    try:
        w.wait_healthy(60)
        body = {**LONG, "max_tokens": 60, "stream": True}
        streamed, result = _in_background(w.url, stream=True, body=body)
        wait_until(lambda: _running(w.url) == 1, 10)
        assert w.popen is not None
        os.killpg(w.popen.pid, signal.SIGTERM)
        streamed.join(30)
        assert result["status"] == 200 and result["lines"][-1] == "data: [DONE]"
        assert not any("error" in line for line in result["lines"]), result["lines"][-3:]
        last = json.loads(result["lines"][-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length"  # all 60 tokens
        assert w.popen.wait(30) in (0, -signal.SIGTERM)
        assert "engine core dead" not in w.log_tail(50)
    finally:
        w.kill()
