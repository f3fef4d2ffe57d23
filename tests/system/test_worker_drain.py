"""Worker rollouts keep every stream: SIGTERM drains a worker (kvgate_cli/drain.py), over real
processes behind a real gateway.

The rollout runs as a StatefulSet runs one: from the highest ordinal down, each pod gets SIGTERM,
exits, and only then is its successor started under the same name (here: the same ports), and
the next pod waits until it is ready. 16 clients stream 6 s generations through the gateway
all along. A draining worker refuses new connections at once (the gateway sends new requests to
the other worker) and finishes its streams: none is cut. With `--drain-timeout 2` the streams
still running are cut with an SSE error event (`server_shutting_down`) and the gateway counts
each (`kvgate_requests_total{status="stream_error"}`).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass, field

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.proc import Proc
from harness.prom import metric_by_labels, metric_total
from tests.support.waits import wait_synced

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
DECODE_S = 0.1
TOKENS = 60  # 6 s per stream on the sim worker: every drain outlasts a second
CLIENTS = 16
RUNNING = "vllm:num_requests_running"
STOPPED = (0, -signal.SIGTERM)
# Failures a client may retry: the connection failed before any answer arrived.
BEFORE_ANSWER = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=2048,
        worker_args=("--sim-decode-s-per-step", str(DECODE_S), "--drain-timeout", "60"),
        gateway_args=("--poll-interval", "0.2"),
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        wait_synced(c.gateway_url, 2)
        yield c


def body(i: int, n: int) -> dict:
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": f"client {i} asks question {n}"}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class Tally:
    completed: int = 0
    cut: list[dict] = field(default_factory=list)  # the error events of cut streams
    lost: list[str] = field(default_factory=list)


def read_stream(lines: list[str], tally: Tally) -> None:
    data = [ln[6:] for ln in lines if ln.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        tally.lost.append(f"no [DONE] (last: {data[-1:]})")
        return
    chunks = [json.loads(d) for d in data[:-1]]
    errors = [ch["error"] for ch in chunks if "error" in ch]
    usage = [ch["usage"] for ch in chunks if ch.get("usage")]
    if errors:
        tally.cut.append(errors[-1])
    elif usage and usage[-1]["completion_tokens"] == TOKENS:
        tally.completed += 1
    else:
        tally.lost.append(f"usage {usage[-1:]}")


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
            await asyncio.sleep(0.05)  # never answered: the SDK's retry
            continue
        if r.status_code != 200:
            tally.lost.append(f"HTTP {r.status_code}")
        else:
            read_stream(lines, tally)
        return
    tally.lost.append("no connection after 4 tries")


async def client(url: str, i: int, stop: asyncio.Event, tally: Tally) -> None:
    async with httpx.AsyncClient(timeout=60) as http:  # keep-alive, as SDK clients are
        n = 0
        while not stop.is_set():
            await one_stream(http, url, body(i, n), tally)
            n += 1


def stream_errors(c: Cluster) -> float:
    counts = metric_by_labels(c.gateway_url, "kvgate_requests_total", "status")
    return counts.get(("stream_error",), 0.0)


def running(c: Cluster) -> float:
    return sum(metric_total(w.url, RUNNING) for w in c.workers)


def wait_running(c: Cluster, at_least: int, w: Proc | None = None, timeout: float = 30) -> None:
    """Until the workers (or `w`) run `at_least` streams: a fixed sleep let a loaded host's first
    SIGTERM land on a worker with none."""
    deadline = time.monotonic() + timeout
    count = lambda: metric_total(w.url, RUNNING) if w else running(c)  # noqa: E731
    while (n := count()) < at_least:
        assert time.monotonic() < deadline, f"{n} streams running after {timeout} s, not {at_least}"
        time.sleep(0.1)


def roll(c: Cluster, w: Proc) -> dict:
    """A StatefulSet's step: SIGTERM, wait for the exit, start the successor, wait until ready."""
    wait_running(c, 4, w)
    running = metric_total(w.url, RUNNING)
    assert w.popen is not None
    t0 = time.monotonic()
    w.popen.send_signal(signal.SIGTERM)
    code = w.popen.wait(90)
    drained = time.monotonic() - t0
    w.start()
    w.wait_healthy(60)
    wait_synced(c.gateway_url, 2)
    return {"running_at_sigterm": running, "exit": code, "drain_s": round(drained, 1)}


@pytest.mark.long  # a rollout under load, as the fault suites: `make test-long`
def test_rolling_the_workers_under_16_streaming_clients_cuts_no_stream(cluster) -> None:
    c = cluster
    errors_before = stream_errors(c)

    async def rollout() -> tuple[Tally, list[dict]]:
        stop, tally = asyncio.Event(), Tally()
        tasks = [asyncio.create_task(client(c.gateway_url, i, stop, tally)) for i in range(16)]
        await asyncio.to_thread(wait_running, c, CLIENTS)  # every client has a stream in flight
        steps = []
        for w in reversed(c.workers):
            steps.append(await asyncio.to_thread(roll, c, w))
        # Every stream that crossed a drain has ended by now (its worker exited); the ones still
        # running began on the new workers: stop them, they are neither completed nor lost.
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return tally, steps

    tally, steps = asyncio.run(rollout())
    print(f"worker rollout: {tally.completed} streams completed, {len(tally.cut)} cut, {steps}")
    assert tally.lost == [], tally.lost[:5]
    assert tally.cut == [], tally.cut[:3]
    assert stream_errors(c) == errors_before  # the gateway saw no stream end in an error
    for step in steps:
        assert step["running_at_sigterm"] >= 4  # each worker was rolled under load
        assert step["exit"] in STOPPED
        assert 1 < step["drain_s"] < 40  # it waited for its streams, and no longer
    assert tally.completed >= CLIENTS  # the streams in flight at the first SIGTERM, at least
    for w in c.workers:
        log = w.log_path.read_text()
        assert "cut 0 open stream" not in log and "Traceback" not in log, w.log_tail()


def test_drain_timeout_cuts_streams_with_an_error_event_and_counts_them(cluster) -> None:
    c = cluster
    for w in c.workers:  # the same workers, now with a 2 s drain
        w.kill()
        w.args += ["--drain-timeout", "2"]
        w.start()
    for w in c.workers:
        w.wait_healthy(60)
    wait_synced(c.gateway_url, 2)
    errors_before = stream_errors(c)

    async def cut() -> tuple[Tally, float]:
        tally = Tally()
        async with httpx.AsyncClient(timeout=60) as http:
            tasks = [
                asyncio.create_task(one_stream(http, c.gateway_url, body(i, 0), tally))
                for i in range(CLIENTS)
            ]
            while await asyncio.to_thread(running, c) < CLIENTS:
                await asyncio.sleep(0.1)
            t0 = time.monotonic()
            for w in c.workers:
                assert w.popen is not None
                w.popen.send_signal(signal.SIGTERM)
            await asyncio.gather(*tasks)
            return tally, time.monotonic() - t0

    tally, took = asyncio.run(cut())
    codes = [w.popen.wait(15) for w in c.workers if w.popen is not None]
    logs = [w.log_path.read_text() for w in c.workers]
    said = [ln for log in logs for ln in log.splitlines() if "--drain-timeout 2s passed: cut" in ln]
    print(f"--drain-timeout 2: {len(tally.cut)} streams cut {took:.1f} s after SIGTERM; {said}")
    assert tally.lost == [] and tally.completed == 0
    assert len(tally.cut) == CLIENTS
    assert {e["code"] for e in tally.cut} == {"server_shutting_down"}
    assert 2 <= took < 8
    assert all(code in STOPPED for code in codes)
    assert stream_errors(c) - errors_before == CLIENTS  # each counted once, by the gateway
    cut_counts = [int(ln.split("cut ")[1].split(" ")[0]) for ln in said]
    assert len(said) == 2 and sum(cut_counts) == CLIENTS  # one line per worker, how many
    for log in logs:
        assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log
