"""An unknown model is a 404 the gateway gives itself; served models are routed."""

from __future__ import annotations

import httpx
import pytest

from bench.cluster import Cluster, ClusterSpec


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(workers=1, engine="sim", log_dir=tmp_path_factory.mktemp("logs"))
    with Cluster(spec) as c:
        yield c


def test_unknown_model_is_404_with_openai_body(cluster: Cluster) -> None:
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{cluster.gateway_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and "no-such-model" in err["message"]
    assert "x-kvgate-replica" not in r.headers  # refused before routing, nothing forwarded


def test_served_model_and_omitted_model_are_routed(cluster: Cluster) -> None:
    for extra in ({"model": "demo"}, {}):
        body = {**extra, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{cluster.gateway_url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-replica"] == cluster.worker_urls[0]
