"""kvgate as an endpoint picker, end to end: real sim workers, a real HTTP gateway, and a real
`python -m gateway --epp` driven over gRPC by a client that plays Envoy's part of ext_proc
(FULL_DUPLEX_STREAMED: headers, body chunks, end of stream; then the forwarded answer)."""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from cachekey.headers import PREFIX_HEADER
from gateway.epp.wire import BODY_CHUNK_BYTES
from harness.cluster import Cluster, ClusterSpec
from harness.extproc_client import ExtProcClient, forward
from harness.ports import HOST, free_port
from harness.proc import Proc
from harness.prom import metric_by_labels, metric_total
from harness.waits import wait_index_converged
from harness.workload import Workload, WorkloadSpec, data_url, make_image
from tests.support.waits import wait_synced

CHAT = "/v1/chat/completions"
HINT_BLOCKS = "kvgate_worker_prefix_hint_blocks_total"
# The recent-prefill term decays with wall time: zeroed here so that two processes holding the
# same index must make the same decision (cost: the match, in-flight and the workers' counts).
GATEWAY_ARGS = (
    "--poll-interval", "0.2",
    "--recent-weight", "0",
    "--max-body-bytes", "256KiB",
    "--epp-fallbacks", "1",  # the ordered list a retrying proxy walks (override_host)
)  # fmt: skip


@dataclass
class Epp:
    proc: Proc
    grpc_port: int

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def target(self) -> str:
        return f"{HOST}:{self.grpc_port}"


def start_epp(c: Cluster, log_dir: Path) -> Epp:
    http, grpc_port = free_port(), free_port()
    args = [
        "-m", "gateway", "--workers", ",".join(c.worker_urls), "--host", HOST,
        "--port", str(http), "--epp", "--epp-port", str(grpc_port), *GATEWAY_ARGS,
    ]  # fmt: skip
    proc = Proc("epp", args, http, log_dir / "epp.log")
    proc.start()
    proc.wait_healthy(60)
    return Epp(proc, grpc_port)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("logs")
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=512,
        gateways=1,
        gateway_args=GATEWAY_ARGS,
        log_dir=log_dir,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        epp = start_epp(c, log_dir)
        try:
            wait_synced(c.gateway_url, 2)
            wait_synced(epp.url, 2)
            yield c, epp
        finally:
            epp.proc.kill()


@pytest.fixture(scope="module")
def client(cluster):
    with ExtProcClient(cluster[1].target) as cl:
        yield cl


def body_of(messages: list[dict], **kw) -> bytes:
    return json.dumps({"model": "demo", "messages": messages, "max_tokens": 4, **kw}).encode()


def endpoint(url: str) -> str:
    return url.removeprefix("http://")


def error_of(ans) -> dict:
    assert ans.immediate.headers.set_headers[0].header.key == "content-type"
    return json.loads(ans.immediate.body)["error"]


def test_health_follows_the_protocol(cluster) -> None:
    with grpc.insecure_channel(cluster[1].target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            got = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert got.status == health_pb2.HealthCheckResponse.SERVING, service


def test_picks_and_predicts_as_the_http_gateway(cluster, client) -> None:
    """Multi-turn multimodal chats: for each request, with both indexes equal to the workers'
    caches, the EPP's pick and predicted cached tokens equal the HTTP gateway's, and both name
    the predicted hit to the worker, which finds that whole chain cached."""
    c, epp = cluster
    hinted = sum(metric_total(u, HINT_BLOCKS) for u in c.worker_urls)
    predicted_blocks = 0
    wl = Workload(WorkloadSpec(tenants=2, users_per_tenant=2, turns=3, system_words=150,
                               image_prob=0.5, seed=5))  # fmt: skip
    histories: dict[str, list[dict]] = {}
    hits = images = 0
    for i, turn in enumerate(wl):
        msgs = histories.setdefault(turn.conversation, wl.initial_messages(turn.tenant))
        msgs.append({"role": "user", "content": turn.content})
        images += isinstance(turn.content, list)
        body = body_of(msgs, temperature=0.0)
        wait_index_converged(c.gateway_url, c.worker_urls)
        wait_index_converged(epp.url, c.worker_urls)
        call = client.call()
        ans = call.request(CHAT, body, chunk=None if i % 2 else 97)  # unstreamed, streamed
        r = httpx.post(f"{c.gateway_url}{CHAT}", content=body, timeout=60,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 200, r.text
        assert ans.endpoints[0] == endpoint(c.served_by(r))
        status, _, relayed = forward(call, ans, CHAT)
        assert status == 200
        assert relayed.set_headers["x-kvgate-replica"] == r.headers["x-kvgate-replica"]
        predicted = relayed.set_headers["x-kvgate-predicted-cached-tokens"]
        assert predicted == r.headers["x-kvgate-predicted-cached-tokens"]
        hits += int(predicted) > 0
        predicted_blocks += int(predicted) // 16
        assert (PREFIX_HEADER in ans.set_headers) == (int(predicted) >= 16)
        msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    assert hits >= len(wl) // 2 and images > 0  # prefixes and images do recur: not vacuous
    # Each prediction was sent twice, by the EPP and by the HTTP gateway.
    hinted = sum(metric_total(u, HINT_BLOCKS) for u in c.worker_urls) - hinted
    assert hinted == 2 * predicted_blocks > 0


def test_answer_follows_the_protocol(cluster, client) -> None:
    c, epp = cluster
    png = data_url(make_image(7))
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "what is in the picture?"},
        {"type": "image_url", "image_url": {"url": png}},
    ]}]  # fmt: skip
    call = client.call()
    ans = call.request(CHAT, body_of(msgs), chunk=1000)
    # The endpoint list: header and metadata hold the same value, the pick first, then the
    # fallback (every other replica, --epp-fallbacks 1), all of them pool endpoints.
    assert ans.metadata == {"envoy.lb": {"x-gateway-destination-endpoint": ",".join(ans.endpoints)}}
    assert sorted(ans.endpoints) == sorted(endpoint(u) for u in c.worker_urls)
    assert ans.clear_route_cache
    # The forwarded body is the gateway's payload: the image part carries the identifier the
    # gateway keyed it by, so the worker keys it alike; content-length follows the new body.
    sent = json.loads(ans.body)
    part = sent["messages"][0]["content"][1]
    assert len(part["uuid"]) > 16 and part["image_url"]["url"] == png
    assert ans.set_headers["content-length"] == str(len(ans.body))
    status, chunks, relayed = forward(call, ans, CHAT)
    assert status == 200 and relayed.body == b"".join(chunks)  # the answer passes unchanged
    # The same image again: its blocks are cached where the first went, and predicted so.
    wait_index_converged(epp.url, c.worker_urls)
    call = client.call()
    again = call.request(CHAT, body_of(msgs))
    _, _, relayed2 = forward(call, again, CHAT)
    assert relayed2.set_headers["x-kvgate-replica"] == relayed.set_headers["x-kvgate-replica"]
    assert int(relayed2.set_headers["x-kvgate-predicted-cached-tokens"]) > 0


def test_streamed_unstreamed_and_large_bodies(cluster, client) -> None:
    _, epp = cluster
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "describe the noise"},
        {"type": "image_url", "image_url": {"url": noise_image(160)}},  # ~100 kB of base64
    ]}]  # fmt: skip
    body = body_of(msgs, stream=True, stream_options={"include_usage": True})
    whole = client.call()
    a = whole.request(CHAT, body)
    whole.close()
    chunked = client.call()
    b = chunked.request(CHAT, body, chunk=4096)
    assert a.body == b.body and a.endpoints[0] == b.endpoints[0]
    # Sent back in pieces of at most 62,000 bytes, the last one ending the stream.
    assert len(b.body_chunks) > 1 and max(b.body_chunks) <= BODY_CHUNK_BYTES
    # The client's stream options are forwarded as they were (the EPP relays nothing).
    assert json.loads(b.body)["stream_options"] == {"include_usage": True}
    before = metric_total(epp.url, "kvgate_prediction_error_tokens_count")
    status, chunks, relayed = forward(chunked, b, CHAT)
    assert status == 200 and b"data: [DONE]" in relayed.body
    assert relayed.body == b"".join(chunks)
    assert relayed.set_headers["x-kvgate-predicted-cached-tokens"].isdigit()
    # The usage chunk was read from the relayed stream: predicted vs reported is recorded.
    deadline = time.monotonic() + 5
    while metric_total(epp.url, "kvgate_prediction_error_tokens_count") <= before:
        assert time.monotonic() < deadline, "the streamed usage was not recorded"
        time.sleep(0.05)


def noise_image(size: int) -> str:
    """A PNG data URL that does not compress: a large body of few tokens."""
    rng = np.random.default_rng(size)
    img = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return data_url(buf.getvalue())


def refused_here(url: str) -> dict[str, float]:
    """kvgate_requests_total of the requests the EPP refused itself, by status."""
    counts = metric_by_labels(url, "kvgate_requests_total", "replica", "status")
    return {status: n for (replica, status), n in counts.items() if replica == "none"}


def test_refusals_are_immediate_responses(cluster, client) -> None:
    c, epp = cluster
    ask = lambda body, **kw: client.call().request(CHAT, body, **kw)  # noqa: E731
    msgs = [{"role": "user", "content": "hi"}]
    before = refused_here(epp.url)

    ans = ask(json.dumps({"model": "nope", "messages": msgs}).encode())
    assert ans.status == 404 and error_of(ans)["code"] == "model_not_found"

    ans = ask(b'{"model": "demo", "messages": [', chunk=5)
    assert ans.status == 400 and error_of(ans)["code"] == "invalid_json"

    big = body_of([{"role": "user", "content": "x" * 300_000}])
    for declared in (True, False):  # refused by content-length, or as the chunks pile up
        headers = {} if declared else {"content-length": ""}
        ans = ask(big, chunk=32_768, headers=headers)
        err = error_of(ans)
        assert ans.status == 413 and err["code"] == "limit_exceeded" and err["param"] == "body"
        assert "--max-body-bytes" in err["message"]

    ans = ask(body_of(msgs), headers={"x-kvgate-routing-policy": "nope"})
    assert ans.status == 400

    # The proxy's subset: the pick stays inside it; a subset with no pool endpoint is a 503.
    w1 = endpoint(c.worker_urls[1])
    call = client.call()
    ans = call.request(CHAT, body_of(msgs), subset=[w1])
    assert ans.endpoints == [w1]
    call.close()
    ans = ask(body_of(msgs), subset="10.255.0.1:8000")
    assert ans.status == 503 and error_of(ans)["code"] == "no_healthy_worker"
    # Each refusal counted once with its status, as the HTTP gateway counts them.
    after = refused_here(epp.url)
    moved = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert moved == {"404": 1, "400": 2, "413": 2, "503": 1}

    # Not an OpenAI completion (no body to key): routed by load, nothing else touched.
    call = client.call()
    ans = call.request("/v1/models", None, method="GET")
    assert ans.endpoints[0] in {endpoint(u) for u in c.worker_urls} and ans.body == b""
    call.close()


def test_a_worker_going_away(cluster, client) -> None:
    """Runs last: it stops the workers. The proxy falls back down the list when the pick is
    gone; the EPP then stops picking it; with no worker left every request is a 503."""
    c, _ = cluster
    msgs = [{"role": "user", "content": "a request whose pick goes away " * 20}]
    call = client.call()
    ans = call.request(CHAT, body_of(msgs))
    picked = next(w for w in c.workers if endpoint(w.url) == ans.endpoints[0])
    other = next(w for w in c.workers if w is not picked)
    picked.kill()
    # The proxy's retry goes to the next endpoint of the list; it reports where it was served.
    assert ans.endpoints[1] == endpoint(other.url)
    status, _, relayed = forward(call, ans, CHAT, served=ans.endpoints[1])
    assert status == 200 and relayed.set_headers["x-kvgate-replica"] == c.replica_name(other.url)

    deadline = time.monotonic() + 10
    while True:  # the EPP's poller notices the worker is gone
        call = client.call()
        ans = call.request(CHAT, body_of(msgs))
        call.close()
        if ans.endpoints == [endpoint(other.url)]:
            break
        assert time.monotonic() < deadline, ans.endpoints
        time.sleep(0.1)
    ans = client.call().request(CHAT, body_of(msgs), subset=[endpoint(picked.url)])
    assert ans.status == 503 and error_of(ans)["code"] == "no_healthy_worker"

    other.kill()
    deadline = time.monotonic() + 10
    while (ans := client.call().request(CHAT, body_of(msgs))).immediate is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    err = error_of(ans)
    assert ans.status == 503 and err["code"] == "no_healthy_worker"
    # Named as clients see replicas (x-kvgate-replica), never by address (docs/security.md).
    assert all(c.replica_name(w.url) in err["message"] for w in (picked, other))
    assert HOST not in err["message"]
