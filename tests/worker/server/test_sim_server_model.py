"""`--sim-server-model`: where a sim worker charges its server's modelled cost, seen from outside
a live worker through the parts of its first tokens (its own histograms, as bench.ttft reads
them). `step`: in the engine step that starts the request; `apart` and `thread`: in the API
server before the request reaches the engine core, leaving the step only the per-uncached-token
term; `apart` holding the API server's event loop meanwhile, `thread` leaving it free."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from harness import worker_metrics as wm
from tests.support.worker_harness import WorkerProcess
from worker.engine.config import EngineConfig
from worker.engine.sim_presets import preset

SCALE = 4.0  # every modelled second four: the host's own milliseconds weigh little beside it


def first_token_parts(model_dir: Path, server_model: str) -> wm.FirstTokenParts:
    """Three requests one at a time (one stream each) to a live preset sim worker."""
    args = ("--sim-preset", "h200-llama-1b", "--sim-time-scale", str(SCALE))
    w = WorkerProcess(model_dir, *args, "--sim-server-model", server_model).start()
    try:
        before = wm.scrape_all([w.url])
        for i in range(3):
            body = {"model": "demo", "prompt": f"request {i} " * 40, "max_tokens": 2}
            r = httpx.post(f"{w.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        parts = wm.first_token_parts(wm.deltas(before, wm.scrape_all([w.url])))
    finally:
        w.stop()
    assert parts is not None
    return parts


@pytest.mark.slow
def test_apart_moves_the_server_cost_from_the_step_to_the_api_server(demo_model_dir: Path):
    host = preset("h200-llama-1b").host(1) * SCALE  # 131 ms: per request and per stream
    step = first_token_parts(demo_model_dir, "step")
    apart = first_token_parts(demo_model_dir, "apart")
    thread = first_token_parts(demo_model_dir, "thread")
    # `step`: the host cost is in the step that starts each request, inside the engine's
    # prefill interval; the API server passes the request on at once.
    assert step.prefill >= host and step.to_engine < host / 2
    # `apart`, `thread`: the API server holds each request that long before the engine has it;
    # the step keeps its prefill and the per-uncached-token term (~100 tokens: 13 ms here).
    for moved in (apart, thread):
        assert moved.to_engine >= host and moved.prefill < step.prefill - host / 2


def health_latency_during_host_work(model_dir: Path, server_model: str) -> float:
    """How long /health takes while a request's modelled host work (about 2 s) runs."""
    args = ("--sim-preset", "h200-llama-1b", "--sim-time-scale", "60")
    w = WorkerProcess(model_dir, *args, "--sim-server-model", server_model).start()
    try:
        body = {"model": "demo", "prompt": "one request", "max_tokens": 1}
        sent = threading.Thread(
            target=lambda: httpx.post(f"{w.url}/v1/completions", json=body, timeout=60)
        )
        sent.start()
        time.sleep(0.5)  # read, rendered, and well into its host work
        t0 = time.monotonic()
        assert httpx.get(f"{w.url}/health", timeout=30).status_code == 200
        took = time.monotonic() - t0
        sent.join(60)
        return took
    finally:
        w.stop()


@pytest.mark.long
def test_apart_holds_the_event_loop_and_thread_leaves_it_free(demo_model_dir: Path):
    host = preset("h200-llama-1b").host(1) * 60  # 1.96 s
    assert health_latency_during_host_work(demo_model_dir, "apart") > host / 4
    assert health_latency_during_host_work(demo_model_dir, "thread") < host / 4


def test_an_unknown_server_model_is_refused(demo_model_dir: Path):
    with pytest.raises(ValueError, match="sim_server_model must be one of step, apart, thread"):
        EngineConfig(model=str(demo_model_dir), engine="sim", sim_server_model="elsewhere")
