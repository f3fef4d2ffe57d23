"""LoRA adapters through a real gateway: kvgate workers (sim engine, real slots and prefix caches)
and a plain vLLM-shaped worker; routing to the replicas that list an adapter, affinity, keys that
match the workers' blocks (completions and embeddings), the model list."""

from __future__ import annotations

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.ports import free_port
from harness.proc import Proc
from harness.waits import wait_index_converged, wait_until
from tests.support.vllm_like import VllmLike
from worker.demo.lora import DEMO_ADAPTERS, write_demo_adapter

PROMPT = "Adapters route to the replicas that hold them, like prefixes do. " * 4


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway-lora")
    return {name: write_demo_adapter(root / name, name) for name in DEMO_ADAPTERS}


@pytest.fixture(scope="module")
def cluster(demo_model_dir, adapters, tmp_path_factory):
    both = f"alpha={adapters['alpha']},beta={adapters['beta']}"
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        model=str(demo_model_dir),
        worker_args=["--max-loras", "1"],
        # worker 0 serves both adapters (one at a time), worker 1 only beta
        per_worker_args=[["--lora-modules", both], ["--lora-modules", f"beta={adapters['beta']}"]],
        gateway_args=["--poll-interval", "0.2"],
        log_dir=tmp_path_factory.mktemp("gateway-lora-logs"),
    )
    with Cluster(spec) as c:
        wait_until(lambda: len(models(c.gateway_url)) == 3, 30, "the gateway's model list")
        yield c


def models(url: str) -> dict[str, str | None]:
    resp = httpx.get(f"{url}/v1/models", timeout=10)
    return {m["id"]: m.get("parent") for m in resp.json().get("data", [])}


def complete(url: str, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp


def test_gateway_lists_adapters(cluster):
    assert models(cluster.gateway_url) == {"demo": None, "alpha": "demo", "beta": "demo"}


def test_an_adapter_goes_to_the_replicas_that_serve_it_and_its_keys_match(cluster):
    w0 = cluster.worker_urls[0]
    first = complete(cluster.gateway_url, "alpha", PROMPT)
    assert cluster.served_by(first) == w0  # the only worker serving alpha
    assert first.json()["model"] == "alpha"
    full_blocks = first.json()["usage"]["prompt_tokens"] // 16
    index = f"{cluster.gateway_url}/kvgate/index"
    wait_until(  # its BlockStored events reached the gateway
        lambda: httpx.get(index).json()["replicas"][w0]["blocks"] >= full_blocks, 10, "events"
    )
    second = complete(cluster.gateway_url, "alpha", PROMPT)
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    # The gateway keyed the request with the adapter's name, exactly as the worker did.
    assert second.headers["x-kvgate-predicted-cached-tokens"] == str(cached)
    # The same prompt for the base model: no block of alpha's is predicted (or served).
    base = complete(cluster.gateway_url, "demo", PROMPT)
    assert base.headers["x-kvgate-predicted-cached-tokens"] == "0"
    assert base.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_affinity_keeps_an_adapter_on_the_replica_with_a_free_slot(cluster):
    w0, w1 = cluster.worker_urls
    complete(cluster.gateway_url, "alpha", "warm alpha up")  # alpha fills worker 0's one slot
    wait_until(lambda: resident(w0) == ["alpha"], 10, "alpha resident on worker 0")
    served = [
        cluster.served_by(complete(cluster.gateway_url, "beta", f"beta question {i}: {PROMPT}"))
        for i in range(6)
    ]
    assert served == [w1] * 6, served  # never evicting alpha on worker 0


def embed(url: str, model: str, text: str) -> httpx.Response:
    resp = httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": text}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == model
    return resp


def predicted_and_cached(resp: httpx.Response) -> tuple[int, int]:
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(resp.headers["x-kvgate-predicted-cached-tokens"]), cached


def test_adapter_embeddings_are_keyed_and_routed_like_completions(cluster):
    gw, (w0, w1) = cluster.gateway_url, cluster.worker_urls
    text = "Embeddings for an adapter are keyed with its name, as its completions are. " * 4
    complete(w0, "beta", "beta takes worker 0's one slot")  # straight to the worker
    wait_until(lambda: resident(w0) == ["beta"], 10, "beta resident on worker 0")
    first = embed(gw, "alpha", text)
    assert cluster.served_by(first) == w0  # the only worker serving alpha
    assert predicted_and_cached(first) == (0, 0)
    # The worker ran the embedding with the adapter: alpha took the slot from beta.
    wait_until(lambda: resident(w0) == ["alpha"], 10, "alpha resident on worker 0")
    wait_index_converged(gw, cluster.worker_urls)
    second = embed(gw, "alpha", text)
    predicted, cached = predicted_and_cached(second)
    assert predicted == cached > 0  # the gateway keyed it with the adapter, as the worker did
    vector = second.json()["data"][0]["embedding"]
    assert vector == first.json()["data"][0]["embedding"]
    # The same input for the base model and for beta: alpha's blocks are neither predicted nor
    # hit, and the vectors differ.
    base = embed(gw, "demo", text)
    assert predicted_and_cached(base) == (0, 0)
    wait_index_converged(gw, cluster.worker_urls)
    beta = embed(gw, "beta", text)
    assert predicted_and_cached(beta) == (0, 0)
    # Affinity: alpha holds worker 0's one slot, so beta goes to worker 1 rather than evict it.
    assert cluster.served_by(beta) == w1
    others = [r.json()["data"][0]["embedding"] for r in (base, beta)]
    assert len({tuple(v) for v in [vector, *others]}) == 3
    unknown = httpx.post(f"{gw}/v1/embeddings", json={"model": "gamma", "input": text}, timeout=30)
    assert unknown.status_code == 404, unknown.text
    assert unknown.json()["error"]["code"] == "model_not_found"


def test_unknown_model_is_404_naming_adapters(cluster):
    resp = httpx.post(
        f"{cluster.gateway_url}/v1/completions", json={"model": "gamma", "prompt": "x"}
    )
    assert resp.status_code == 404
    message = resp.json()["error"]["message"]
    assert message == "The model `gamma` does not exist. Served models: `demo`, `alpha`, `beta`"


def resident(url: str) -> list[str]:
    return httpx.get(f"{url}/kvgate/info", timeout=10).json()["lora"]["resident"]


def test_plain_vllm_adapter_is_keyed_with_its_name(tmp_path, demo_model_dir):
    fake = VllmLike(adapters=["sql"])  # lists it, and writes vLLM's lora metric
    port = free_port()
    args = ["-m", "gateway", "--workers", fake.url, "--port", str(port), "--model-dir"]
    args += [str(demo_model_dir), "--vllm-kv-events-port", str(fake.events_port)]
    gw = Proc("gateway", [*args, "--poll-interval", "0.2"], port, tmp_path / "gw.log")
    gw.start()
    try:
        gw.wait_healthy(60)
        index = f"{gw.url}/kvgate/index"
        wait_until(lambda: httpx.get(index).json()["replicas"][fake.url]["synced"], 10, "sync")
        fake.subscribed()
        assert models(gw.url) == {"demo": None, "sql": "demo"}
        prompt = list(range(100, 150))  # 3 full blocks + 2 tokens
        body = {"model": "sql", "prompt": prompt, "max_tokens": 1}
        first = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=30)
        assert first.status_code == 200, first.text
        assert fake.lora_seen == ["sql"]
        wait_until(lambda: httpx.get(index).json()["replicas"][fake.url]["blocks"] >= 3, 10)
        second = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=30)
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert second.headers["x-kvgate-predicted-cached-tokens"] == "48"
        base = httpx.post(f"{gw.url}/v1/completions", json={**body, "model": "demo"}, timeout=30)
        assert base.headers["x-kvgate-predicted-cached-tokens"] == "0"
    finally:
        gw.kill()
        fake.close()
