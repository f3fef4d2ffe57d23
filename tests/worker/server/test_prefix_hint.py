"""A worker acts on the gateway's `x-kvgate-prefix` as soon as a request's headers are in, before
its body, and only for a request that passed the token check. A real sim worker, raw sockets for
a body that arrives late, and the worker's own counter of refreshed blocks."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from cachekey.headers import PREFIX_HEADER
from harness.cluster import Cluster, ClusterSpec
from harness.prom import metric_total
from harness.waits import wait_until
from tests.support.chat import bearer, post

TOKEN = "prefix-hint-test-token"
AUTH = bearer(TOKEN)
HINT_BLOCKS = "kvgate_worker_prefix_hint_blocks_total"
BODY = {"model": "demo", "prompt": list(range(10, 90)), "max_tokens": 1}  # 5 full blocks
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=256,
        gateways=0,
        worker_token=TOKEN,
        log_dir=tmp_path_factory.mktemp("logs"),
    )
    with Cluster(spec) as c:
        url = c.worker_urls[0]
        r = post(url, BODY, COMPLETIONS, AUTH)
        assert r.status_code == 200, r.text
        yield url, _last_key(url)


def _last_key(url: str) -> str:
    """The key of the cached chain's last block: the one no block names as its parent."""
    blocks = httpx.get(f"{url}/kv/snapshot", headers=AUTH, timeout=10).json()["blocks"]
    parents = {b["parent"] for b in blocks}
    (last,) = [b["key"] for b in blocks if b["key"] not in parents]
    return last


def _hinted(url: str) -> float:
    return metric_total(url, HINT_BLOCKS, headers=AUTH)


def _head(url: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [
        "POST /v1/completions HTTP/1.1",
        f"host: {urlsplit(url).netloc}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "the worker closed the connection without an answer"
        data += chunk
    return int(data.split(b" ", 2)[1])


def test_the_chain_is_refreshed_while_the_body_is_still_on_its_way(worker) -> None:
    url, last = worker
    before = _hinted(url)
    body = json.dumps(BODY).encode()
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(_head(url, body, {**AUTH, PREFIX_HEADER: last}) + body[:12])
        wait_until(lambda: _hinted(url) == before + 5, 10, "the hint acted on before the body")
        sock.sendall(body[12:])
        assert _status(sock) == 200


def test_only_an_authenticated_well_formed_hint_for_a_held_chain_counts(worker) -> None:
    """Hints that must change nothing go first; the engine runs posted commands in order, so
    the valid hint sent last finds the counter moved by its own 5 blocks only."""
    url, last = worker
    before = _hinted(url)
    hints = [
        {PREFIX_HEADER: last},  # no token: 401
        {**AUTH, PREFIX_HEADER: "not-a-key"},
        {**AUTH, PREFIX_HEADER: "ab" * 16},  # a chain nobody holds
        {**AUTH, PREFIX_HEADER: last, "x-data-parallel-rank": "7"},  # no such rank: 400
        {**AUTH, PREFIX_HEADER: last},
    ]
    codes = [post(url, BODY, COMPLETIONS, headers).status_code for headers in hints]
    assert codes == [401, 200, 200, 400, 200]
    wait_until(lambda: _hinted(url) >= before + 5, 10, "the valid hint")
    assert _hinted(url) == before + 5
