"""Observability endpoints and replica names (issue 14, finding 8), on a real gateway.

`/metrics` and `/kvgate/index` needed no key and showed per-request token deltas and every
worker; `x-kvgate-replica` (and the 503s) named worker URLs. With `--admin-port` both endpoints
are answered only there, and clients see a replica name keyed by the worker token.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from gateway.names import replica_name
from harness.cluster import Cluster, ClusterSpec
from harness.ports import HOST, free_port
from harness.proc import Proc
from harness.waits import wait_until
from tests.support.chat import chat, user
from tests.support.waits import try_get

pytestmark = pytest.mark.slow

TOKEN = "admin-" + "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
NAME = re.compile(r"^w-[0-9a-f]{12}$")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    admin = free_port()
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=256,
        worker_token=TOKEN,
        gateway_args=("--poll-interval", "0.2", "--admin-port", str(admin)),
        log_dir=tmp_path_factory.mktemp("admin"),
        startup_timeout=90,
    )
    with Cluster(spec) as c:
        c.admin_url = f"http://{HOST}:{admin}"
        yield c


@pytest.mark.parametrize("path", ["/metrics", "/kvgate/index"])
def test_admin_endpoints_are_gone_from_the_public_port(cluster, path: str) -> None:
    assert chat(cluster.gateway_url, user("make some metrics")).status_code == 200
    r = httpx.get(cluster.gateway_url + path, timeout=10)
    assert r.status_code == 404, r.text[:200]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "admin port" in err["message"]
    assert err["code"] == "unknown_url", err
    assert "kvgate_" not in r.text and "127.0.0.1" not in r.text
    served = httpx.get(cluster.admin_url + path, timeout=10)
    assert served.status_code == 200
    assert ("kvgate_requests_total" in served.text) if path == "/metrics" else served.json()


@pytest.mark.parametrize(
    ("method", "path"), [("POST", "/v1/chat/completions"), ("GET", "/v1/models")]
)
def test_the_admin_port_serves_nothing_else(cluster, method: str, path: str) -> None:
    r = httpx.request(method, cluster.admin_url + path, json={}, timeout=10)
    err = r.json()["error"]
    assert r.status_code == 404 and "public port" in err["message"] and err["code"] == "unknown_url"
    assert httpx.get(cluster.admin_url + "/health", timeout=10).status_code == 200


def test_the_replica_header_is_a_name_not_a_url(cluster) -> None:
    seen = set()
    for i in range(12):
        r = chat(cluster.gateway_url, user(f"who served me? {i} " * 8))
        assert r.status_code == 200
        name = r.headers["x-kvgate-replica"]
        assert NAME.match(name), name
        seen.add(name)
    # Operators map names to workers on the admin port.
    index = httpx.get(cluster.admin_url + "/kvgate/index", timeout=10).json()["replicas"]
    names = {entry["name"]: url for url, entry in index.items()}
    assert seen <= names.keys() and set(names.values()) == set(cluster.worker_urls)
    # Keyed by the worker token: the name of a guessed URL cannot be computed without it.
    for url in cluster.worker_urls:
        assert replica_name(url, None) not in names
        assert cluster.replica_name(url) in names


def test_every_gateway_gives_a_worker_the_same_name(cluster, tmp_path: Path) -> None:
    """A session followed across gateway replicas sees one name per worker."""
    port = free_port()
    args = ["-m", "gateway", "--workers", ",".join(cluster.worker_urls), "--host", HOST,
            "--port", str(port), "--poll-interval", "0.2"]  # fmt: skip
    other = Proc("gateway-2", args, port, tmp_path / "gateway-2.log")
    other.env = {"KVGATE_WORKER_TOKEN": TOKEN}
    other.start()
    try:
        other.wait_healthy(60)
        r = chat(other.url, user("same names everywhere"))
        assert r.status_code == 200
        assert cluster.served_by(r) in cluster.worker_urls
    finally:
        other.kill()


def test_a_503_names_no_worker_address(tmp_path: Path) -> None:
    dead = f"http://{HOST}:{free_port()}"
    port = free_port()
    args = ["-m", "gateway", "--workers", dead, "--host", HOST, "--port", str(port),
            "--poll-interval", "0.2", "--connect-timeout", "0.5"]  # fmt: skip
    gw = Proc("gateway-dead", args, port, tmp_path / "gateway.log")
    gw.start()
    try:
        wait_until(
            lambda: (r := try_get(f"{gw.url}/health")) is not None and "unreachable" in r.text,
            30,
            "the first poll",
        )
        for r in (
            httpx.get(f"{gw.url}/health", timeout=5),
            chat(gw.url, user("anyone there?")),
            httpx.get(f"{gw.url}/v1/models", timeout=5),
        ):
            assert r.status_code == 503
            message = r.json()["error"]["message"]
            assert replica_name(dead, None) in message and dead not in message
            assert HOST not in message
        assert dead in gw.log_path.read_text()  # the operator's log still says which
    finally:
        gw.kill()
