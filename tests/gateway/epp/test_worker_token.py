"""The worker token in EPP mode (issue 14, finding 1): the proxy, not the gateway, forwards.

With kvgate as an InferencePool's endpoint picker the Gateway's proxy sends each request to the
worker itself. The EPP holds the worker token and sets it on the forwarded request through the
ext_proc header mutation, replacing whatever credential the client sent, so a worker that
answers only its gateways serves the proxy's requests and never sees a tenant's API key.
"""

from __future__ import annotations

import json

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.extproc_client import ExtProcClient, forward
from harness.ports import HOST, free_port
from harness.proc import Proc

pytestmark = pytest.mark.slow

TOKEN = "epp-" + "c0ffee00" * 4
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def epp(tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("epp")
    spec = ClusterSpec(workers=1, engine="sim", num_blocks=256, gateways=0, worker_token=TOKEN,
                       log_dir=log_dir, startup_timeout=60)  # fmt: skip
    with Cluster(spec) as c:
        http, grpc_port = free_port(), free_port()
        args = ["-m", "gateway", "--workers", c.worker_urls[0], "--host", HOST,
                "--port", str(http), "--epp", "--epp-port", str(grpc_port),
                "--poll-interval", "0.2"]  # fmt: skip
        proc = Proc("epp", args, http, log_dir / "epp.log", env={"KVGATE_WORKER_TOKEN": TOKEN})
        proc.start()
        try:
            proc.wait_healthy(60)
            with ExtProcClient(f"{HOST}:{grpc_port}") as client:
                yield c, client
        finally:
            proc.kill()


def _body(text: str) -> bytes:
    msgs = [{"role": "user", "content": text}]
    return json.dumps({"model": "demo", "messages": msgs, "max_tokens": 2}).encode()


def test_the_forwarded_request_carries_the_worker_token(epp) -> None:
    c, client = epp
    call = client.call()
    ans = call.request(CHAT, _body("through the proxy " * 10),
                       headers={"authorization": "Bearer sk-tenant-key"})  # fmt: skip
    assert ans.set_headers["authorization"] == f"Bearer {TOKEN}"  # the client's key replaced
    status, _, relayed = forward(call, ans, CHAT)
    assert status == 200
    assert relayed.set_headers["x-kvgate-replica"] == c.replica_name(c.worker_urls[0])
    # What a proxy without the EPP's header would get: the worker refuses it.
    r = httpx.post(f"{c.worker_urls[0]}{CHAT}", content=ans.body,
                   headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == 401


@pytest.mark.parametrize("path", ["/kv/snapshot", "/kvgate/assets", "/kvgate/info", "/metrics"])
def test_internal_endpoints_stay_closed_through_the_proxy(epp, path: str) -> None:
    """A client asking the Gateway for a worker's snapshot or tokenizer: the EPP routes it (by
    load) without the token, so the worker refuses it as it refuses any pod."""
    _, client = epp
    call = client.call()
    ans = call.request(path, None, method="GET", headers={"authorization": "Bearer guess"})
    assert "authorization" not in ans.set_headers
    worker = ans.endpoints[0]
    r = httpx.get(f"http://{worker}{path}", headers={"authorization": "Bearer guess"}, timeout=10)
    assert r.status_code == 401
    call.close()


def test_the_model_list_goes_through_with_the_token(epp) -> None:
    _, client = epp
    call = client.call()
    ans = call.request("/v1/models", None, method="GET")
    assert ans.set_headers["authorization"] == f"Bearer {TOKEN}"
    worker = ans.endpoints[0]
    r = httpx.get(f"http://{worker}/v1/models", headers=ans.set_headers, timeout=10)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "demo"
    call.close()
