"""A gateway that says what is wrong: unreachable workers are logged (rate-limited) until they
come up, and 503s and /v1/models name every worker and why it takes no traffic."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.fleet.replica import Replica
from gateway.fleet.replica_set import ReplicaSet
from gateway.index.block_index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.names import replica_name
from harness.cluster import Cluster, ClusterSpec
from harness.ports import HOST, free_port
from harness.proc import Proc
from harness.waits import wait_until
from tests.support.waits import try_get


def test_unreachable_worker_named_until_it_comes_up(tmp_path) -> None:
    c = Cluster(ClusterSpec(workers=1, engine="sim", log_dir=tmp_path))
    worker = c.make_worker(0)  # its port is chosen; the process is not started yet
    port = free_port()
    gw = Proc(
        "gateway",
        ["-m", "gateway", "--workers", worker.url, "--host", HOST, "--port", str(port),
         "--poll-interval", "0.2"],
        port,
        tmp_path / "gateway.log",
    )  # fmt: skip
    gw.start()
    try:
        # The gateway listens before its first poll ("not polled yet"); wait for the poll.
        wait_until(
            lambda: (
                (r := try_get(f"{gw.url}/health")) is not None and "not polled yet" not in r.text
            ),
            30,
            "the gateway's first poll",
        )
        health = httpx.get(f"{gw.url}/health", timeout=5)  # 503 until the worker is up
        assert health.status_code == 503
        chat = httpx.post(
            f"{gw.url}/v1/chat/completions",
            json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        models = httpx.get(f"{gw.url}/v1/models", timeout=10)
        for r in (health, chat, models):
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("server_error", "no_healthy_worker")
            # Clients see the replica's name, never its address; the log has the address.
            name = replica_name(worker.url, None)
            assert f"{name} (unreachable: ConnectionRefusedError)" in err["message"], err["message"]
            assert worker.url not in err["message"]
        log = gw.log_path.read_text()
        where = f"{name} ({worker.url})"  # the name, and the URL to join it with
        line = f"worker {where} takes no traffic: unreachable: ConnectionRefusedError"
        assert log.count(line) == 1, log  # logged at once, then only every 30 s
        worker.start()
        worker.wait_healthy(60)
        wait_until(lambda: (r := try_get(f"{gw.url}/health")) and r.status_code == 200, 30, "up")
        assert f"replica {where} healthy" in gw.log_path.read_text()
        ok = httpx.post(
            f"{gw.url}/v1/chat/completions",
            json={
                "model": "demo",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}],
            },
            timeout=30,
        )
        assert ok.status_code == 200, ok.text
    finally:
        gw.kill()
        worker.kill()


def test_down_worker_is_logged_again_only_after_the_rate_limit(caplog) -> None:
    """Real polls of a closed port: the first is logged, the next ones not until 30 s passed."""
    url = f"http://{HOST}:{free_port()}"

    async def scenario() -> None:
        http = httpx.AsyncClient()
        replicas = ReplicaSet(
            GatewayConfig(connect_timeout=1.0), BlockIndex(), GatewayMetrics(), http
        )
        rep = replicas.replicas[url] = Replica(url, url)
        try:
            for _ in range(3):
                await replicas.poll_once(rep)
            assert rep.health.down_reason == "unreachable: ConnectionRefusedError"
            where = f"{rep.name} ({url})"
            assert caplog.text.count(f"worker {where} takes no traffic") == 1
            rep.health.warned_at -= 31.0  # as if the rate limit's 30 s had passed
            await replicas.poll_once(rep)
            assert caplog.text.count(f"worker {where} takes no traffic") == 2
        finally:
            await replicas.close()
            await http.aclose()

    with caplog.at_level(logging.WARNING, logger="gateway.fleet.replica_set"):
        asyncio.run(scenario())


def test_no_workers_at_all_is_a_warning(caplog) -> None:
    from gateway.app import create_app

    with caplog.at_level(logging.WARNING, logger="gateway.app"):
        create_app(GatewayConfig())
    assert "no workers: start the gateway with --workers" in caplog.text


@pytest.mark.parametrize("ejected", [False, True])
def test_describe_names_health_reasons(ejected: bool) -> None:
    rep = Replica("http://w0", "http://w0", healthy=False)
    rep.health.down_reason = "/health 503: engine dead"
    if ejected:
        rep.circuit.open_until = time.monotonic() + 60
        rep.health.down_reason = "ejected after 3 failures in a row (last: HTTP 500)"
    text = rep.describe(time.monotonic())
    assert text == f"{replica_name('http://w0', None)} ({rep.health.down_reason})"
    rep.healthy, rep.parity_ok = True, False
    rep.circuit.close()
    assert "parity mismatch" in rep.describe(time.monotonic())


def test_a_wrong_worker_token_is_named_as_soon_as_the_worker_answers(tmp_path) -> None:
    """The gateway starts first (the worker is not up: unreachable), then the worker comes up
    with another token: the 401 is logged at its first poll, not when the 30 s rate limit of
    the earlier reason runs out."""
    c = Cluster(ClusterSpec(workers=1, engine="sim", log_dir=tmp_path, worker_token="a" * 32))
    worker = c.make_worker(0)
    port = free_port()
    gw = Proc(
        "gateway",
        ["-m", "gateway", "--workers", worker.url, "--host", HOST, "--port", str(port),
         "--poll-interval", "0.2"],
        port,
        tmp_path / "gateway.log",
        env={"KVGATE_WORKER_TOKEN": "b" * 32},
    )  # fmt: skip
    gw.start()
    try:
        wait_until(lambda: "no traffic: unreachable: " in gw.log_path.read_text(), 30, "a poll")
        worker.start()
        worker.wait_healthy(60)
        up = time.monotonic()
        refused = "takes no traffic: /kvgate/info answered 401: the worker does not take this"
        wait_until(lambda: refused in gw.log_path.read_text(), 10, "the 401 in the log")
        assert time.monotonic() - up < 10  # the earlier reason was logged under 30 s before
    finally:
        gw.kill()
        worker.kill()


def test_debug_logs_show_decisions_not_http_internals(tmp_path) -> None:
    """--log-level debug: the routing explanations, none of the HTTP client's wire events;
    --log-level-http debug brings those back."""
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        gateway_args=("--poll-interval", "0.1", "--log-level", "debug"),
        log_dir=tmp_path,
    )
    with Cluster(spec) as c:
        wire = c.make_gateway(1)
        wire.args += ["--log-level-http", "debug"]
        c.gateways.append(wire)
        wire.start()
        wire.wait_healthy(60)
        body = {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for g in c.gateways:
            for _ in range(3):
                r = httpx.post(f"{g.url}/v1/chat/completions", json=body, timeout=30)
                assert r.status_code == 200, r.text
        time.sleep(1.0)  # ten polls of the worker each
        debug, http_debug = (g.log_path.read_text() for g in c.gateways)
    assert debug.count("DEBUG gateway.routing.policies.cache_aware: cache_aware") >= 3
    assert "httpcore" not in debug and "httpx" not in debug
    assert http_debug.count("DEBUG httpcore") >= 10
