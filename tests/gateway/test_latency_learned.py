"""The gateway learns each replica's TTFT from the streams it proxies: through a real gateway
and two sim workers timed like the GPU (`--sim-preset`), once enough requests have come back,
its predictions are counted in kvgate_route_ttft_prediction_error_ratio and are close."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway.fleet.latency import MIN_SAMPLES
from harness.cluster import Cluster, ClusterSpec
from tests.support.chat import chat_body, user

REQUESTS = 6 * MIN_SAMPLES
CONCURRENCY = 4


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=512,
        worker_args=("--sim-preset", "h200-llama-1b", "--sim-server-scale", "0.5"),
        gateway_args=("--poll-interval", "0.2"),
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        yield c.gateway_url


def _stream(gw: str, i: int) -> None:
    # Four prefixes of different lengths, so the fit sees uncached tokens vary.
    system = f"tenant {i % 4} " + "shared words " * (40 * (1 + i % 4))
    body = chat_body(user(f"{system} question {i}"), max_tokens=4, stream=True)
    with httpx.stream("POST", f"{gw}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for _ in r.iter_bytes():
            pass


def _histogram(text: str, name: str) -> tuple[float, float]:
    count = re.search(rf"^{name}_count (\S+)$", text, re.M)
    total = re.search(rf"^{name}_sum (\S+)$", text, re.M)
    assert count and total, text[:2000]
    return float(count.group(1)), float(total.group(1))


def test_gateway_learns_ttft_from_the_streams_it_proxies(gateway_url: str):
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(lambda i: _stream(gateway_url, i), range(REQUESTS)))
    text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
    count, total = _histogram(text, "kvgate_route_ttft_prediction_error_ratio")
    # Every request sent to a replica after its first MIN_SAMPLES came back was predicted (up
    # to CONCURRENCY more were sent before they had).
    assert REQUESTS - 2 * (MIN_SAMPLES + CONCURRENCY) <= count <= REQUESTS
    assert total / count < 0.5  # mean |observed - predicted| / observed
    # Each replica's own fit is exported: the requests queued or running there cost time.
    terms = re.findall(
        r'^kvgate_replica_ttft_model_seconds\{replica="([^"]+)",term="(per_waiting|per_request)"\}'
        r" (\S+)$",
        text,
        re.M,
    )
    load: dict[str, float] = {}
    for replica, _, value in terms:
        load[replica] = load.get(replica, 0.0) + float(value)
    assert len(load) == 2 and all(v > 0 for v in load.values()), terms
