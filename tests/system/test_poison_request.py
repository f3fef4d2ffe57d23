"""A request that kills every engine it is in (fault injection's `poison`, worker/server/faults.py)
takes two workers, not every one the gateway would retry it on, and its client's retries reach
none (gateway/quarantine.py). Real processes: three sim workers and a gateway on 127.0.0.1."""

from __future__ import annotations

import time

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.prom import metric_total

pytestmark = [pytest.mark.slow, pytest.mark.long]  # whole clusters under faults: make test-long

MARKER = "NIGHTSHADE"
CHAT = "/v1/chat/completions"


def chat(url: str, text: str) -> httpx.Response:
    body = {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    return httpx.post(url + CHAT, json=body, timeout=30)


def healthy(url: str) -> bool:
    return httpx.get(url + "/health", timeout=5).status_code == 200


def test_a_poison_request_kills_two_workers_and_is_then_refused(tmp_path) -> None:
    spec = ClusterSpec(
        workers=3,
        engine="sim",
        num_blocks=256,
        gateway_args=("--poll-interval", "0.2", "--retries", "2", "--poison-ttl", "60"),
        # Steps slow enough that the request is still in the engine when its crash arrives.
        worker_args=("--enable-fault-injection", "--sim-decode-s-per-step", "0.05"),
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        for url in c.worker_urls:
            armed = httpx.post(url + "/debug/fault", params={"kind": "poison", "marker": MARKER})
            assert armed.status_code == 200, armed.text
        poison = f"please eat the {MARKER}"
        r = chat(c.gateway_url, poison)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "engine_killer", r.text
        alive = [url for url in c.worker_urls if healthy(url)]
        assert len(alive) == 1, "the first attempt and one retry: two engines, not three"
        (survivor,) = alive
        served = metric_total(survivor, "vllm:prompt_tokens_total")

        # Its client's retry (the same body) is refused by the gateway, and reaches nobody.
        t0 = time.monotonic()
        again = chat(c.gateway_url, poison)
        assert again.status_code == 400 and again.json()["error"]["code"] == "engine_killer"
        assert time.monotonic() - t0 < 2
        assert healthy(survivor) and metric_total(survivor, "vllm:prompt_tokens_total") == served

        # Anything else is served by the survivor, once the gateway has seen the others die.
        deadline = time.monotonic() + 10
        while (ok := chat(c.gateway_url, "a harmless question")).status_code != 200:
            assert time.monotonic() < deadline, ok.text
            time.sleep(0.2)
        assert c.served_by(ok) == survivor
