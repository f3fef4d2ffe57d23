"""Rollouts drop nothing: SIGTERM drains a gateway (HTTP and EPP mode) over real processes.

The rollout runs as Kubernetes runs one behind a Service: the new gateway starts and is added
to the Service once ready; the old one is taken out of the Service, and after a moment (the
chart's preStop) gets SIGTERM. The old one then refuses new connections and fails readiness at
once, finishes the streams it has in flight, and exits. 16 clients stream all along through the
Service, keep-alive connections included; like the OpenAI SDK they retry a request whose
connection failed before any answer (never one that was answered), and the workers' own
counters prove that no request was run twice.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.cluster import Cluster, ClusterSpec
from harness.extproc_client import ExtProcClient, forward
from harness.ports import HOST, free_port
from harness.proc import Proc
from harness.prom import metric_total
from harness.waits import wait_until
from tests.support.service_front import ServiceFront

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
DECODE_S = 0.02
TOKENS = 60  # about 1.2 s per stream: several are in flight on the old gateway at SIGTERM
CLIENTS = 16
# How a gateway ends after SIGTERM: uvicorn re-raises the signal once it has shut down cleanly.
STOPPED = (0, -signal.SIGTERM)
SERVED = "vllm:e2e_request_latency_seconds_count"
# Failures a client may retry: the connection failed before any answer arrived.
BEFORE_ANSWER = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=512,
        worker_args=("--sim-decode-s-per-step", str(DECODE_S)),
        gateway_args=("--poll-interval", "0.2"),
        gateways=0,
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        yield c


def start_gateway(c: Cluster, i: int, *args: str) -> Proc:
    g = c.make_gateway(i)
    g.args += list(args)
    c.gateways.append(g)
    g.start()
    g.wait_healthy(60)
    return g


def served(c: Cluster) -> float:
    return sum(metric_total(url, SERVED) for url in c.worker_urls)


def refused(port: int) -> bool:
    """Whether a new connection to `port` is refused (nobody listens there any more)."""
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) != 0


def body(i: int, n: int, tokens: int = TOKENS) -> dict:
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": f"client {i} asks question {n}"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class Tally:
    completed: int = 0
    retried: int = 0
    lost: list[str] = field(default_factory=list)


def check_stream(lines: list[str]) -> str | None:
    """Why a relayed stream is not a whole answer (None when it is)."""
    data = [ln[6:] for ln in lines if ln.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        return f"no [DONE] (last: {data[-1:]})"
    chunks = [json.loads(d) for d in data[:-1]]
    if any("error" in ch for ch in chunks):
        return "an error event"
    usage = [ch["usage"] for ch in chunks if ch.get("usage")]
    if not usage or usage[-1]["completion_tokens"] != TOKENS:
        return f"usage {usage[-1:]}"
    return None


async def one_stream(http: httpx.AsyncClient, url: str, req: dict, tally: Tally) -> None:
    for _ in range(4):
        try:
            async with http.stream("POST", f"{url}{CHAT}", json=req) as r:
                try:
                    lines = [ln async for ln in r.aiter_lines()]
                except httpx.HTTPError as e:  # answered, then broken: lost
                    tally.lost.append(f"stream broke: {type(e).__name__}: {e}")
                    return
        except BEFORE_ANSWER:
            tally.retried += 1  # never answered: the SDK's retry
            await asyncio.sleep(0.05)
            continue
        why = f"HTTP {r.status_code}" if r.status_code != 200 else check_stream(lines)
        if why is None:
            tally.completed += 1
        else:
            tally.lost.append(why)
        return
    tally.lost.append("no connection after 4 tries")


async def client(url: str, i: int, stop: asyncio.Event, tally: Tally) -> None:
    async with httpx.AsyncClient(timeout=30) as http:  # keep-alive, as SDK clients are
        n = 0
        while not stop.is_set():
            await one_stream(http, url, body(i, n), tally)
            n += 1


@pytest.mark.long  # a rollout under load, as the fault suites: `make test-long`
def test_rolling_the_gateway_under_16_streaming_clients_loses_nothing(cluster) -> None:
    c = cluster
    old = start_gateway(c, 0)
    before = served(c)

    async def roll() -> tuple[Tally, dict]:
        front = ServiceFront()
        await front.start()
        front.endpoints = [old.port]
        stop, tally = asyncio.Event(), Tally()
        clients = [asyncio.create_task(client(front.url, i, stop, tally)) for i in range(CLIENTS)]
        await asyncio.sleep(2.0)
        new = await asyncio.to_thread(start_gateway, c, 1)
        front.endpoints = [old.port, new.port]  # ready: the Service adds it
        await asyncio.sleep(1.0)
        # The old pod is deleted: out of the Service, then (after the preStop) SIGTERM.
        front.endpoints = [new.port]
        await asyncio.sleep(0.3)
        in_flight = await asyncio.to_thread(metric_total, old.url, "kvgate_in_flight_requests")
        t0 = time.monotonic()
        assert old.popen is not None
        old.popen.send_signal(signal.SIGTERM)
        seen = {"in_flight_at_sigterm": in_flight}
        # Draining: new connections refused while the old process still finishes its streams.
        while old.alive() and not refused(old.port):
            await asyncio.sleep(0.01)
        seen["refused_while_alive"] = old.alive()
        exit_code = await asyncio.to_thread(old.popen.wait, 30)
        seen["exit"], seen["drain_s"] = exit_code, time.monotonic() - t0
        await asyncio.sleep(2.0)  # the clients go on through the new gateway
        stop.set()
        await asyncio.gather(*clients)
        await front.stop()
        seen["connections"] = dict(front.connections)
        return tally, seen

    tally, seen = asyncio.run(roll())
    print(f"rollout: {tally.completed} streams completed, {tally.retried} retried, {seen}")
    assert tally.lost == [], tally.lost[:5]
    assert seen["in_flight_at_sigterm"] >= 4  # the roll happened under load
    assert seen["refused_while_alive"]  # stopped taking connections before it finished
    assert seen["exit"] in STOPPED and seen["drain_s"] < 10  # done when its streams were, not 30 s
    assert "timeout graceful shutdown exceeded" not in old.log_path.read_text()
    new_port = c.gateways[1].port
    assert seen["connections"][new_port] >= CLIENTS  # everyone moved over
    # Each completed stream ran exactly once on a worker: no retry repeated a served request.
    assert served(c) - before == tally.completed
    assert tally.completed >= 4 * CLIENTS
    for g in c.gateways:
        g.kill()
    c.gateways.clear()


def test_drain_is_bounded_by_drain_timeout(cluster) -> None:
    """A stream longer than --drain-timeout is cut when the bound passes, with an SSE error
    event the client can read and one log line saying how many; the process exits."""
    c = cluster
    g = start_gateway(c, 2, "--drain-timeout", "2")
    long = body(0, 0, tokens=2000)  # 40 s on the sim worker
    with httpx.stream("POST", f"{g.url}{CHAT}", json=long, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        t0 = time.monotonic()
        assert g.popen is not None
        g.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: refused(g.port), 2, "the listener to close")
        rest = list(lines)  # the stream ends cleanly, with an error event and [DONE]
        cut_after = time.monotonic() - t0
        assert g.popen.wait(15) in STOPPED
        took = time.monotonic() - t0
    data = [ln[6:] for ln in rest if ln.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    error = json.loads(data[-2])["error"]
    print(f"drain bound 2 s: cut after {cut_after:.2f} s, exited {took:.2f} s after SIGTERM")
    assert error["code"] == "server_shutting_down" and "--drain-timeout 2s" in error["message"]
    assert 2 <= cut_after < 4 and took < 8, (cut_after, took)
    log = g.log_path.read_text()
    assert "drain: --drain-timeout 2s passed: cut 1 open stream(s)" in log
    assert "timeout graceful shutdown exceeded" not in log and "Traceback" not in log
    c.gateways.clear()


def test_epp_drains_on_sigterm(cluster) -> None:
    """EPP mode: readiness fails and new ext_proc streams are refused at once; the stream in
    flight goes on to its answer, then the process exits (long before --drain-timeout)."""
    c = cluster
    grpc_port = free_port()
    epp = start_gateway(c, 3, "--epp", "--epp-port", str(grpc_port), "--drain-timeout", "30")
    target = f"{HOST}:{grpc_port}"
    req = json.dumps(body(0, 0, tokens=8) | {"stream": False}).encode()
    with ExtProcClient(target) as cl:
        wait_until(lambda: _readiness(target) == "SERVING", 20, "the EPP to be ready")
        call = cl.call()
        ans = call.request(CHAT, req)
        assert ans.immediate is None and ans.endpoints
        t0 = time.monotonic()
        assert epp.popen is not None
        epp.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: _readiness(target) != "SERVING", 5, "readiness to fail")
        with pytest.raises(grpc.RpcError):  # a new stream: refused (the proxy goes elsewhere)
            cl.call().request(CHAT, req)
        assert epp.alive()  # still serving the stream in flight
        status, _, relayed = forward(call, ans, CHAT)
        assert status == 200 and "x-kvgate-replica" in relayed.set_headers
    assert epp.popen.wait(15) in STOPPED
    took = time.monotonic() - t0
    print(f"EPP drain: exited {took:.2f} s after SIGTERM")
    assert took < 10
    c.gateways.clear()


def _readiness(target: str) -> str:
    """The EPP's gRPC `readiness` status, or UNAVAILABLE when nothing answers."""
    with grpc.insecure_channel(target) as ch:
        try:
            got = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=2
            )
        except grpc.RpcError:
            return "UNAVAILABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(got.status)
