"""An unknown model is a 404 the gateway gives itself; served models are routed; the gateway's
error bodies have the worker's format, as OpenAI's API writes them."""

from __future__ import annotations

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec


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
    assert (err["type"], err["code"]) == ("invalid_request_error", "model_not_found")
    assert "Served models: `demo`" in err["message"]
    assert "x-kvgate-replica" not in r.headers  # refused before routing, nothing forwarded
    # The worker, asked directly, answers the same status with the same type and code.
    w = httpx.post(f"{cluster.worker_urls[0]}/v1/chat/completions", json=body, timeout=30)
    assert w.status_code == 404
    werr = w.json()["error"]
    assert set(werr) == set(err) == {"message", "type", "param", "code"}
    assert (werr["type"], werr["code"], werr["param"]) == (err["type"], err["code"], "model")


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"messages": []}, "messages", "at least 1 item"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "maybe"}, "stream", "bool"),
        ({"prompt": "hi", "max_tokens": 2, "logprobs": 2}, None, "logprobs"),
    ],
)
def test_invalid_requests_name_the_field_without_pydantic_prefixes(
    cluster: Cluster, body: dict, param: str | None, needle: str
) -> None:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    # The gateway forwards logprobs untouched; the worker refuses it: both bodies are clean.
    for url in (cluster.gateway_url, cluster.worker_urls[0]):
        r = httpx.post(f"{url}{path}", json={"model": "demo", **body}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and needle in err["message"]
        assert "Value error" not in err["message"] and "validation error" not in err["message"]
        if param is not None:
            assert err["param"] == param


def test_served_model_and_omitted_model_are_routed(cluster: Cluster) -> None:
    for extra in ({"model": "demo"}, {}):
        body = {**extra, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{cluster.gateway_url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert cluster.served_by(r) == cluster.worker_urls[0]
