"""What the probes mean, and every refusal counted, on a real gateway process whose only worker
is down (nothing listens on its port).

`/ready` (the chart's readiness probe) says "I can answer": 200 with no worker, so clients reach
the gateway and get its 503 naming why, instead of a Service with no endpoints. `/health` says
whether a request would be routed now. Every answer of 400 or more, on any route and method,
moves `kvgate_requests_total` by exactly one; the probes' own answers move nothing.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from harness.ports import HOST, free_port
from harness.proc import Proc
from harness.prom import metric_total
from harness.waits import wait_until
from tests.support.chat import bearer, chat_body, user

pytestmark = pytest.mark.slow

KEY = "sk-probes-test-key-0001"
REQUESTS = "kvgate_requests_total"
# 20 odd requests: (method, path, with the API key, the status expected).
ODD = [
    ("GET", "/nope", True, 404),
    ("POST", "/nope", True, 404),
    ("HEAD", "/nope", True, 404),
    ("GET", "/v1", True, 404),
    ("GET", "/kvgate", True, 404),
    ("GET", "/v1/chat", True, 404),
    ("DELETE", "/v1/chat/completions/x", True, 404),
    ("GET", "/v1/chat/completions", True, 405),
    ("PUT", "/v1/chat/completions", True, 405),
    ("OPTIONS", "/v1/chat/completions", True, 405),
    ("DELETE", "/v1/completions", True, 405),
    ("PATCH", "/v1/embeddings", True, 405),
    ("POST", "/v1/models", True, 405),
    ("HEAD", "/v1/models", True, 405),
    ("DELETE", "/health", True, 405),
    ("POST", "/metrics", True, 405),
    ("PUT", "/kvgate/index", True, 405),
    ("GET", "/v1/models", False, 401),
    ("GET", "/v1/models", True, 503),
    ("POST", "/v1/chat/completions", False, 401),  # the proxied path counts its own, once
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("probes")
    keys = logs / "keys.txt"
    keys.write_text(f"{KEY} alice\n")
    dead = f"http://{HOST}:{free_port()}"  # nothing listens there
    port = free_port()
    args = ["-m", "gateway", "--workers", dead, "--host", HOST, "--port", str(port)]
    args += ["--poll-interval", "0.2", "--api-keys-file", str(keys)]
    g = Proc("gateway", args, port, logs / "gateway.log")
    g.start()
    try:
        wait_ready(g)
        yield g
    finally:
        g.kill()


def wait_ready(g: Proc) -> None:
    def ready() -> bool:
        assert g.alive(), g.log_tail()
        try:
            return httpx.get(f"{g.url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, 60, "the gateway's /ready")


def test_ready_waits_for_the_first_poll_only(tmp_path) -> None:
    """/ready is 503 `starting` until the gateway knows its workers' state, then 200 though the
    worker is down. A worker that takes 2 s to answer (its listener queues the poll) holds it."""
    slow = socket.socket()
    slow.bind((HOST, 0))
    slow.listen(1)  # accepts into the backlog, never answers: the poll times out
    port = free_port()
    args = ["-m", "gateway", "--workers", f"http://{HOST}:{slow.getsockname()[1]}"]
    args += ["--host", HOST, "--port", str(port), "--connect-timeout", "1"]
    g = Proc("gateway", args, port, tmp_path / "gateway.log")
    g.start()
    try:
        wait_until(lambda: _status(g, "/health") == 503, 30, "the gateway to listen")
        first = httpx.get(f"{g.url}/ready", timeout=5)
        assert first.status_code == 503 and first.json()["error"]["code"] == "starting"
        wait_until(lambda: _status(g, "/ready") == 200, 10, "the first poll to time out")
        assert _status(g, "/health") == 503  # still no worker: ready, and answering so
    finally:
        g.kill()
        slow.close()


def _status(g: Proc, path: str) -> int | None:
    try:
        return httpx.get(f"{g.url}{path}", timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_with_every_worker_down_the_gateway_stays_ready_and_says_why(gateway) -> None:
    g = gateway
    ready = httpx.get(f"{g.url}/ready", timeout=5)
    assert ready.status_code == 200 and ready.json()["healthy_replicas"] == 0
    health = httpx.get(f"{g.url}/health", timeout=5)
    assert health.status_code == 503
    r = httpx.post(
        f"{g.url}/v1/chat/completions",
        json=chat_body(user("anyone there?")),
        headers=bearer(KEY),
        timeout=10,
    )
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "no_healthy_worker"
    assert "unreachable: ConnectionRefusedError" in err["message"], err["message"]


def test_twenty_odd_routes_and_methods_move_requests_total_by_exactly_twenty(gateway) -> None:
    g = gateway
    before = metric_total(g.url, REQUESTS)
    with httpx.Client(base_url=g.url, timeout=10) as http:
        for method, path, keyed, status in ODD:
            headers = bearer(KEY) if keyed else {}
            r = http.request(method, path, headers=headers)
            assert r.status_code == status, (method, path, r.status_code, r.text[:200])
        # The probes' own answers are states, not refusals: they move nothing.
        assert http.get("/health").status_code == 503
        assert http.get("/ready").status_code == 200
    moved = metric_total(g.url, REQUESTS) - before
    print(f"{len(ODD)} odd requests moved {REQUESTS} by {moved:g}")
    assert len(ODD) == 20 and moved == 20
