"""A plain vLLM worker behind the gateway: no /kvgate/info, vLLM's positional events, int hashes.

The peer is `vllm_like.VllmLike` in live mode (HTTP + ZMQ PUB): it speaks vLLM's wire formats
(`/v1/models`, `vllm:cache_config_info`, array_like KV events with 64-bit int block hashes from
its own hash function), so the gateway's real code path is exercised.
"""

from __future__ import annotations

import time

import httpx
import pytest

from harness.ports import free_port
from harness.proc import Proc
from tests.support.vllm_like import VllmLike


@pytest.fixture()
def fake_vllm():
    fake = VllmLike()
    yield fake
    fake.close()


def test_plain_vllm_worker_is_indexed_from_its_events(tmp_path, demo_model_dir, fake_vllm):
    port = free_port()
    args = [
        "-m",
        "gateway",
        "--workers",
        fake_vllm.url,
        "--port",
        str(port),
        "--model-dir",
        str(demo_model_dir),
        "--vllm-kv-events-port",
        str(fake_vllm.events_port),
        "--poll-interval",
        "0.2",
    ]
    gw = Proc("gateway", args, port, tmp_path / "gw.log")
    gw.start()
    try:
        gw.wait_healthy(60)
        deadline = time.monotonic() + 10
        while not httpx.get(f"{gw.url}/kvgate/index").json()["replicas"][fake_vllm.url]["synced"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        fake_vllm.subscribed()
        prompt = list(range(100, 150))  # 3 full blocks + 2 tokens
        body = {"model": "demo", "prompt": prompt, "max_tokens": 1}
        first = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=30)
        assert first.status_code == 200, first.text
        assert first.headers["x-kvgate-predicted-cached-tokens"] == "0"
        deadline = time.monotonic() + 10
        while httpx.get(f"{gw.url}/kvgate/index").json()["replicas"][fake_vllm.url]["blocks"] < 3:
            assert time.monotonic() < deadline, gw.log_tail()
            time.sleep(0.1)
        second = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=30)
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert second.headers["x-kvgate-predicted-cached-tokens"] == "48"
    finally:
        gw.kill()
