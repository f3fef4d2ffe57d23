"""Slow and partial request bodies, sent over raw sockets to a real gateway and a real worker.

A client that sent a Content-Length and then part of its body (or none) held its connection, its
task and what it sent for as long as it liked, and the gateway even allocated the declared
length at once: 300 such connections stayed unanswered, and each declared 32 MiB cost the
gateway 32 MiB. Now each side answers such a body 408 `--body-read-timeout` s after its headers,
and refuses (429, Retry-After) a body that would take the bytes being read past
`--body-read-budget` (cachekey/bodies.py), while it keeps serving everyone else.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.ports import HOST
from harness.proc import rss_bytes
from harness.waits import wait_until
from tests.support.chat import CHAT, chat, chat_body, user
from tests.support.raw_http import read_response

pytestmark = [pytest.mark.slow, pytest.mark.long]  # whole clusters under faults: make test-long

DEADLINE = 4.0
MAX_BODY = 16 * 2**20
HOLDERS = 3  # partial bodies of MAX_BODY - 1 bytes that fill the budget
LIMITS = (
    "--max-body-bytes", f"{MAX_BODY}",
    "--body-read-timeout", f"{DEADLINE:g}",
    "--body-read-budget", f"{HOLDERS * MAX_BODY}",
)  # fmt: skip
SIDES = ("gateway", "worker")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=256,
        worker_args=LIMITS,
        gateway_args=("--poll-interval", "0.2", *LIMITS),
        log_dir=tmp_path_factory.mktemp("slow-bodies"),
        startup_timeout=90,
    )
    with Cluster(spec) as c:
        yield c


def _proc(cluster: Cluster, side: str):
    return cluster.gateways[0] if side == "gateway" else cluster.workers[0]


def _partial(cluster: Cluster, side: str, declared: int, sent: int) -> socket.socket:
    """A connection that sent a chat request's headers, declaring `declared` body bytes, and
    the first `sent` bytes of the body."""
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    ).encode()
    s = socket.create_connection((HOST, _proc(cluster, side).port), timeout=DEADLINE + 20)
    s.sendall(head + (b'{"model": "demo", "messages": [' + b" " * sent)[:sent])
    return s


def _chunked(cluster: Cluster, side: str, first: int) -> socket.socket:
    """A connection that sent a chat request's headers without a length (chunked) and one chunk
    of `first` bytes: only its chunks can say how large it is."""
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    s = socket.create_connection((HOST, _proc(cluster, side).port), timeout=DEADLINE + 20)
    s.sendall(head + b"%x\r\n" % first + b" " * first + b"\r\n")
    return s


def _response(s: socket.socket) -> tuple[int, dict[str, str], dict]:
    """(status, headers, JSON body) of one HTTP/1.1 response with a Content-Length."""
    status, headers, body = read_response(s)
    return status, headers, json.loads(body)


def _probe(cluster: Cluster, side: str) -> httpx.Response:
    """A small, whole chat request: answered 200 unless the budget is full."""
    return chat(_proc(cluster, side).url, user("still serving"), timeout=30)


@pytest.mark.parametrize("sent", [0, 300], ids=["headers-only", "half-body"])
@pytest.mark.parametrize("side", SIDES)
def test_a_partial_body_gets_408_within_the_deadline(cluster, side: str, sent: int) -> None:
    start = time.monotonic()
    with _partial(cluster, side, 600, sent) as s:
        ok = _probe(cluster, side)  # meanwhile, everyone else is served at once
        assert ok.status_code == 200, ok.text
        assert time.monotonic() - start < DEADLINE
        status, headers, body = _response(s)
        took = time.monotonic() - start
        assert s.recv(1) == b""  # and the connection is closed: its body's rest is never read
    assert status == 408, body
    assert DEADLINE - 0.5 < took < DEADLINE + 3, took
    assert headers["connection"] == "close"
    err = body["error"]
    assert (err["type"], err["code"], err["param"]) == (
        "invalid_request_error",
        "request_timeout",
        "body",
    )
    assert "--body-read-timeout" in err["message"] and f"{sent} bytes received" in err["message"]


def test_the_gateway_counts_its_408s(cluster) -> None:
    with _partial(cluster, "gateway", 600, 10) as s:
        assert _response(s)[0] == 408
    text = httpx.get(f"{cluster.gateway_url}/metrics", timeout=10).text
    counted = [
        line
        for line in text.splitlines()
        if line.startswith("kvgate_requests_total{") and 'status="408"' in line
    ]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 1, counted


@pytest.mark.parametrize("side", SIDES)
def test_the_budget_refuses_one_body_more_and_takes_bodies_again(cluster, side: str) -> None:
    holders = [_partial(cluster, side, MAX_BODY, MAX_BODY - 1) for _ in range(HOLDERS)]
    try:
        # Full once the holders' bytes are in: then even a small whole request is refused.
        wait_until(lambda: _probe(cluster, side).status_code == 429, 2, "the budget full")
        with _partial(cluster, side, MAX_BODY, 100) as one_more:
            status, headers, body = _response(one_more)
        assert status == 429, body
        assert int(headers["retry-after"]) >= 1
        err = body["error"]
        assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "--body-read-budget" in err["message"]
        with _chunked(cluster, side, 100) as unsized:  # refused by its first chunk
            status, headers, body = _response(unsized)
        assert status == 429 and int(headers["retry-after"]) >= 1, body
    finally:
        for s in holders:
            s.close()
    wait_until(lambda: _probe(cluster, side).status_code == 200, 5, "the budget free again")


def test_a_workers_429_keeps_its_retry_after_through_the_gateway(cluster) -> None:
    """The worker's budget full, a request the gateway forwards is the worker's 429: the
    gateway passes on its Retry-After with its body (it used to drop the header)."""
    holders = [_partial(cluster, "worker", MAX_BODY, MAX_BODY - 1) for _ in range(HOLDERS)]
    try:
        wait_until(lambda: _probe(cluster, "worker").status_code == 429, 2, "the budget full")
        r = chat(cluster.gateway_url, user("through the gateway"), timeout=30)
        assert r.status_code == 429, r.text
        assert "--body-read-budget" in r.json()["error"]["message"]  # the worker's own answer
        assert int(r.headers["retry-after"]) >= 1
    finally:
        for s in holders:
            s.close()
    wait_until(lambda: _probe(cluster, "worker").status_code == 200, 5, "the budget free again")


@pytest.mark.parametrize("side", SIDES)
def test_a_declared_length_alone_holds_neither_memory_nor_budget(cluster, side: str) -> None:
    """Before, the gateway allocated a body's declared length before reading it: 8 headers
    declaring 16 MiB each took it up 128 MiB. Declared lengths are not counted in the budget
    either, so idle connections cannot refuse everyone else's bodies."""
    proc = _proc(cluster, side)
    assert proc.pid is not None
    before = rss_bytes(proc.pid) or 0
    idle = [_partial(cluster, side, MAX_BODY, 0) for _ in range(2 * HOLDERS + 2)]
    try:
        ok = _probe(cluster, side)
        assert ok.status_code == 200, ok.text
        grew = (rss_bytes(proc.pid) or 0) - before
        assert grew < 2 * MAX_BODY, f"{side} grew {grew >> 20} MiB"
    finally:
        for s in idle:
            s.close()


@pytest.mark.parametrize("side", SIDES)
def test_a_slow_body_that_ends_in_time_is_served(cluster, side: str) -> None:
    payload = json.dumps(chat_body(user("slow but on time"), max_tokens=2)).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((HOST, _proc(cluster, side).port), timeout=30) as s:
        s.sendall(head + payload[:10])
        time.sleep(DEADLINE / 4)
        s.sendall(payload[10:])
        status, _, body = _response(s)
    assert status == 200, body
