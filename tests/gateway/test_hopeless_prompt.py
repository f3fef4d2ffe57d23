"""A prompt whose size alone proves it past the context is refused before it is tokenized
(cachekey/token_bound.py), through a real gateway in front of a real sim worker: the 12 MB chat of
issue 39 ("x " six million times, under the 32 MB body limit) cost 31-37 s of gateway CPU."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.prom import metric_total

pytestmark = pytest.mark.slow

SERVED = "vllm:e2e_request_latency_seconds_count"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=256,
        gateway_args=("--poll-interval", "0.2"),
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        yield c


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 6_000_000}]}),
        ("/v1/completions", {"prompt": "x " * 6_000_000}),
    ],
)
def test_a_12_mb_prompt_is_refused_in_under_a_second(cluster, path: str, body: dict) -> None:
    c = cluster
    data = json.dumps({"model": "demo", "max_tokens": 4, **body}).encode()
    served = metric_total(c.worker_urls[0], SERVED)
    with httpx.Client(timeout=60) as http:
        http.get(f"{c.gateway_url}/health")  # the connection is up: time the request alone
        t0 = time.perf_counter()
        r = http.post(
            f"{c.gateway_url}{path}", content=data, headers={"content-type": "application/json"}
        )
        took = time.perf_counter() - t0
    print(f"{path}: {len(data) / 1e6:.1f} MB refused in {took:.2f} s: {r.text[:160]}")
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
    assert took < 1.0
    assert metric_total(c.worker_urls[0], SERVED) == served  # never reached the worker
