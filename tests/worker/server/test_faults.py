"""Honest health: a dead or stalled engine loop turns /health 503 and requests fail fast;
a client that goes away aborts its engine request."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from harness.waits import wait_until
from tests.support.worker_harness import WorkerProcess

SLOW = ("--sim-decode-s-per-step", "0.02", "--enable-fault-injection")
LONG = {"model": "demo", "prompt": "tell me a long story", "max_tokens": 3000, "ignore_eos": True}


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def _stream_in_background(url: str) -> tuple[threading.Thread, dict]:
    result: dict = {"chunks": [], "error": None}
    started = threading.Event()

    def run() -> None:
        try:
            with httpx.stream(
                "POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=60
            ) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if line:
                        result["chunks"].append(line)
                        started.set()
        except httpx.HTTPError as e:
            result["error"] = e
        finally:
            result["done_at"] = time.monotonic()
            started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(20)
    return t, result


@pytest.mark.parametrize("kind", ["crash_engine", "stall_engine"])
def test_dead_engine_fails_health_and_requests_fast(demo_model_dir, kind):
    args = (*SLOW, "--engine-stall-timeout", "1.0")
    with WorkerProcess(demo_model_dir, *args, events=False) as w:
        t, result = _stream_in_background(w.url)
        wait_until(lambda: _metric(w.url, "vllm:num_requests_running") == 1, 3)
        r = httpx.post(w.url + "/debug/fault", params={"kind": kind})
        assert r.status_code == 200
        injected = time.monotonic()
        took = wait_until(lambda: httpx.get(w.url + "/health").status_code == 503, 5)
        assert took < 4
        body = httpx.get(w.url + "/health").json()
        assert "engine" in body["error"]["message"]
        # The in-flight stream ends with an in-band error instead of hanging.
        t.join(10)
        assert not t.is_alive()
        assert result["done_at"] - injected < 5
        # It was in the engine: `engine_died`, which a gateway does not retry on replica after
        # replica (gateway/quarantine.py).
        assert any('"engine_died"' in c for c in result["chunks"]), result["chunks"]
        assert result["chunks"][-1] == "data: [DONE]"
        # New requests are refused at once: the engine was dead before them (`engine_dead`).
        t0 = time.monotonic()
        r = httpx.post(w.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=10)
        assert r.status_code == 503
        assert time.monotonic() - t0 < 1.0
        assert r.json()["error"]["type"] == "server_error"
        assert r.json()["error"]["code"] == "engine_dead"
        # The HTTP layer itself still answers (info, metrics) so operators can see why.
        assert httpx.get(w.url + "/kvgate/info").status_code == 200


def test_fault_endpoint_absent_without_flag(demo_model_dir):
    with WorkerProcess(demo_model_dir, events=False) as w:
        assert (
            httpx.post(w.url + "/debug/fault", params={"kind": "crash_engine"}).status_code == 404
        )
        r = httpx.post(w.url + "/debug/fault", params={"kind": "crash_engine"})
        assert r.json()["error"]["code"] == "unknown_url"
        assert httpx.get(w.url + "/health").status_code == 200


def test_client_disconnect_aborts_stream_and_plain_requests(demo_model_dir):
    with WorkerProcess(demo_model_dir, *SLOW, events=False) as w:
        # Streaming: read a few chunks, then hang up.
        with httpx.stream("POST", w.url + "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            wait_until(lambda: _metric(w.url, "vllm:num_requests_running") == 1, 3)
            assert _metric(w.url, "vllm:kv_cache_usage_perc") > 0
        wait_until(lambda: _metric(w.url, "vllm:num_requests_running") == 0, 3)
        wait_until(lambda: _metric(w.url, "vllm:kv_cache_usage_perc") == 0, 3)

        # Not streamed: the client gives up (timeout closes the connection).
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(w.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(5, read=0.5))
        wait_until(lambda: _metric(w.url, "vllm:num_requests_running") == 0, 3)
        wait_until(lambda: _metric(w.url, "vllm:kv_cache_usage_perc") == 0, 3)
        gen = _metric(w.url, "vllm:generation_tokens_total")
        time.sleep(0.3)
        assert _metric(w.url, "vllm:generation_tokens_total") == gen  # nothing still decoding
        # And the worker keeps serving.
        ok = httpx.post(w.url + "/v1/completions", json={**LONG, "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
