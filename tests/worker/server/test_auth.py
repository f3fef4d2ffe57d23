"""Workers trust only the gateway (issue 14, finding 1), as attacks on real processes.

A pod that reached a worker read every tenant's prompts: `/kv/snapshot` lists the cached token
ids and `/kvgate/assets` hands out the tokenizer that decodes them, and `POST
/reset_prefix_cache` was open. Now every worker endpoint but `/health` wants the shared worker
token, which the gateway sends on every call (forwarding, polls, snapshots, assets, models).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cachekey.assets import ModelAssets
from cachekey.documents import AssetFiles, Snapshot, WorkerInfo, decode_document
from harness.cluster import Cluster, ClusterSpec
from harness.ports import HOST, free_port
from harness.proc import Proc
from harness.waits import wait_until
from tests.support.chat import bearer, chat, post, user
from tests.support.json_bombs import many_keys, many_objects, reset_peak_rss, status_kib
from tests.support.raw_http import read_response
from tests.support.waits import try_get
from tests.support.worker_harness import WorkerProcess

pytestmark = pytest.mark.slow

TOKEN = "wt-" + "3f9c1a7e5b2d4c6e8a0b1c2d3e4f5a6b"
AS_GATEWAY = bearer(TOKEN)
SECRET_PROMPT = "Tenant A's merger plan: acquire Initech for 41 dollars a share, announce in May."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=512,
        worker_token=TOKEN,
        gateway_args=("--poll-interval", "0.2"),
        log_dir=tmp_path_factory.mktemp("workers"),
        startup_timeout=90,
    )
    with Cluster(spec) as c:
        yield c


def _refused(r: httpx.Response) -> None:
    assert r.status_code == 401, (r.request.method, r.request.url, r.status_code, r.text[:200])
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
    assert "worker token" in err["message"] and TOKEN not in r.text
    assert r.headers["www-authenticate"].startswith("Bearer")


def _routes(worker_url: str) -> list[tuple[str, str]]:
    """Every (method, path) the worker serves, from its own OpenAPI schema (read as a gateway)."""
    schema = httpx.get(f"{worker_url}/openapi.json", headers=AS_GATEWAY, timeout=10).json()
    routes = [
        (method.upper(), path)
        for path, item in schema["paths"].items()
        for method in item
        if method in ("get", "post", "put", "delete", "patch")
    ]
    return [*routes, ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/path")]


WRONG = {
    "none": {},
    "another token": {"authorization": "Bearer " + "x" * len(TOKEN)},
    "no Bearer": {"authorization": TOKEN},
    "a longer token": {"authorization": f"Bearer {TOKEN}0"},
    "a shorter token": {"authorization": f"Bearer {TOKEN[:-1]}"},
    "another header": {"x-api-key": TOKEN},
}


@pytest.mark.parametrize("how", list(WRONG))
def test_every_worker_endpoint_but_health_needs_the_token(cluster, how: str) -> None:
    worker = cluster.workers[0].url
    routes = _routes(worker)
    assert ("GET", "/kv/snapshot") in routes and ("POST", "/reset_prefix_cache") in routes
    with httpx.Client(timeout=10, headers=WRONG[how]) as client:
        for method, path in routes:
            r = client.request(method, worker + path, json={} if method == "POST" else None)
            if path == "/health":
                assert r.status_code == 200
            else:
                _refused(r)


def test_prompts_cannot_be_read_from_a_worker_without_the_token(cluster) -> None:
    """The attack: another tenant's prompt, decoded from a worker's snapshot and tokenizer."""
    assert chat(cluster.gateway_url, user(SECRET_PROMPT * 3)).status_code == 200
    worker = cluster.workers[0].url
    _refused(httpx.get(f"{worker}/kv/snapshot", timeout=10))
    _refused(httpx.get(f"{worker}/kvgate/assets", timeout=10))
    # What the attacker would have read, had the worker answered without the token.
    snap = httpx.get(f"{worker}/kv/snapshot", headers=AS_GATEWAY, timeout=10)
    files = httpx.get(f"{worker}/kvgate/assets", headers=AS_GATEWAY, timeout=10)
    tokenizer = ModelAssets.from_files(decode_document(files.content, AssetFiles).files).tokenizer
    blocks = decode_document(snap.content, Snapshot).blocks
    text = tokenizer.decode([t for b in blocks for t in b.token_ids])
    assert "merger plan" in text


def test_reset_prefix_cache_needs_the_token(cluster) -> None:
    assert chat(cluster.gateway_url, user("keep this cached " * 30)).status_code == 200
    worker = cluster.workers[0].url

    def cached() -> int:
        snap = httpx.get(f"{worker}/kv/snapshot", headers=AS_GATEWAY, timeout=10)
        return len(decode_document(snap.content, Snapshot).blocks)

    before = cached()
    assert before > 0
    _refused(httpx.post(f"{worker}/reset_prefix_cache", timeout=10))
    assert cached() == before  # nothing was reset
    r = httpx.post(f"{worker}/reset_prefix_cache", headers=AS_GATEWAY, timeout=10)
    assert r.json() == {"reset": True} and cached() == 0


def test_the_gateway_sends_the_token_on_every_worker_call(cluster) -> None:
    """Forwarding (plain and streamed), /v1/models, polls, the snapshot and the KV events: the
    gateway's index of the worker equals the worker's snapshot, read with the token."""
    gw, worker = cluster.gateway_url, cluster.workers[0].url
    assert chat(gw, user("through the gateway " * 20)).status_code == 200
    with httpx.stream(
        "POST",
        f"{gw}/v1/chat/completions",
        json={"model": "demo", "max_tokens": 3, "stream": True,
              "messages": [{"role": "user", "content": "streamed " * 20}]},
        timeout=60,
    ) as r:  # fmt: skip
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    models = httpx.get(f"{gw}/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "demo"
    info = decode_document(
        httpx.get(f"{worker}/kvgate/info", headers=AS_GATEWAY).content, WorkerInfo
    )
    assert info.kv_events.curve  # the events are CURVE-encrypted: the gateway holds the keys

    def index_matches_snapshot() -> bool:
        snap = httpx.get(f"{worker}/kv/snapshot", headers=AS_GATEWAY, timeout=10)
        keys = {b.key for b in decode_document(snap.content, Snapshot).blocks}
        (entry,) = httpx.get(f"{gw}/kvgate/index", timeout=10).json()["replicas"].values()
        return entry["synced"] and entry["blocks"] == len(keys) > 0

    wait_until(index_matches_snapshot, 20, "the gateway's index to match the worker's cache")


def test_the_token_is_never_logged_nor_shown(cluster) -> None:
    assert chat(cluster.gateway_url, user("one more")).status_code == 200
    for proc in [*cluster.gateways, *cluster.workers]:
        assert TOKEN not in proc.log_path.read_text(errors="replace"), proc.name
        cmdline = Path(f"/proc/{proc.popen.pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline, proc.name  # given in the environment
    assert TOKEN not in httpx.get(f"{cluster.gateway_url}/metrics").text
    worker_metrics = httpx.get(f"{cluster.workers[0].url}/metrics", headers=AS_GATEWAY)
    assert worker_metrics.status_code == 200 and TOKEN not in worker_metrics.text


def test_a_gateway_with_another_token_gets_nothing(cluster, tmp_path: Path) -> None:
    """A gateway (or anyone) holding a different token: the worker is down for it, and its 503
    says why without naming the worker's address."""
    port = free_port()
    args = ["-m", "gateway", "--workers", cluster.workers[0].url, "--host", HOST,
            "--port", str(port), "--poll-interval", "0.2"]  # fmt: skip
    other = Proc("gateway-other", args, port, tmp_path / "other.log")
    other.env = {"KVGATE_WORKER_TOKEN": "another-token-" + "0" * 20}
    other.start()
    try:
        health = f"{other.url}/health"
        wait_until(lambda: try_get(health) is not None, 30, "the other gateway")
        wait_until(lambda: (r := try_get(health)) is not None and "401" in r.text, 30, "a poll")
        message = httpx.get(health, timeout=5).json()["error"]["message"]
        assert "does not take this gateway's worker token" in message
        assert cluster.workers[0].url not in message and HOST not in message
    finally:
        other.kill()


def test_metrics_can_be_opened_to_a_scraper_alone(demo_model_dir: Path) -> None:
    env = {"KVGATE_WORKER_TOKEN": TOKEN}
    with WorkerProcess(demo_model_dir, "--unauthenticated-metrics", events=False, env=env) as w:
        assert httpx.get(f"{w.url}/metrics").status_code == 200
        _refused(httpx.get(f"{w.url}/kv/snapshot"))
        _refused(httpx.get(f"{w.url}/kvgate/info"))


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_a_weak_token_is_refused_at_start(command: str) -> None:
    weak = "hunter2"
    env = dict(os.environ, KVGATE_WORKER_TOKEN=weak)
    argv = [sys.executable, "-m", command] + (["--model", "demo"] if command == "worker" else [])
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "worker token must be at least 16 characters" in proc.stderr
    assert weak not in proc.stderr + proc.stdout


# ---- the worker's request bodies (finding 5, sent to the worker itself) -----------------------


@pytest.mark.parametrize("make", [many_keys, many_objects])
def test_32_mib_of_elements_leaves_the_worker_flat(cluster, make) -> None:
    """A 32 MiB `{...}` body took a worker to 1.0 GB (json.loads, then pydantic): now the
    element bound refuses it on the raw bytes, at a few copies of the body."""
    worker = cluster.workers[0]
    pid = worker.popen.pid
    before = reset_peak_rss(pid)
    r = post(worker.url, make(32 * 2**20 - 1024), headers=AS_GATEWAY, timeout=120)
    peak = status_kib(pid, "VmHWM")
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "json_too_large" and "--max-json-elements" in err["message"]
    grew_mib = (peak - before) / 1024
    print(f"{make.__name__}: worker RSS {before / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB")
    assert grew_mib < 160, grew_mib


@pytest.mark.parametrize("depth", [65, 100_000])
def test_deep_nesting_to_a_worker_is_a_400(cluster, depth: int) -> None:
    junk = b"[" * depth + b"]" * depth
    body = b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "x": ' + junk + b"}"
    r = post(cluster.workers[0].url, body, headers=AS_GATEWAY, timeout=120)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "json_too_deep" and "--max-json-depth" in err["message"]


def test_a_declared_huge_body_is_refused_before_it_is_sent(cluster) -> None:
    """Content-Length past --max-body-bytes (128 MiB): a 413 at once, nothing read."""
    port = cluster.workers[0].port
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Length: {200 * 2**20}\r\n\r\n"
    )
    with socket.create_connection((HOST, port), timeout=10) as s:
        s.sendall(head.encode() + b'{"model": "demo", "prompt": "')
        status, _, body = read_response(s)
    assert status == 413, body
    assert "--max-body-bytes" in json.loads(body)["error"]["message"]


def test_a_malformed_body_is_a_400_and_the_worker_keeps_serving(cluster) -> None:
    worker = cluster.workers[0].url
    r = post(worker, b'{"model": "demo", "messages": [', headers=AS_GATEWAY, timeout=120)
    err = r.json()["error"]
    assert r.status_code == 400 and err["message"].startswith("invalid JSON body: ")
    assert err["code"] == "invalid_json"  # as the gateway words it
    ok = post(
        worker,
        b'{"model": "demo", "max_tokens": 2, "prompt": "hi"}',
        "/v1/completions",
        headers=AS_GATEWAY,
        timeout=120,
    )
    assert ok.status_code == 200, ok.text
    assert chat(cluster.gateway_url, user("still serving")).status_code == 200


def test_configs_never_show_the_token(monkeypatch) -> None:
    from gateway.config import GatewayConfig
    from worker.server.config import ServerConfig

    monkeypatch.setenv("KVGATE_WORKER_TOKEN", TOKEN)
    for config in (GatewayConfig(), ServerConfig()):
        assert config.worker_token == TOKEN  # taken from the environment
        assert TOKEN not in repr(config) and "worker_token" not in repr(config)
