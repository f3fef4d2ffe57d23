"""The gateway end to end: real `python -m worker --engine sim` processes and real gateways."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.waits import wait_index_converged
from harness.workload import Workload, WorkloadSpec
from tests.support.chat import chat, image_message, user
from tests.support.paths import REPO
from tests.support.waits import wait_synced

GATEWAY_ARGS = ("--poll-interval", "0.2", "--image-fetch-allow", "127.0.0.1/32")
GREEDY = {"max_tokens": 4, "temperature": 0.0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=512,
        gateways=2,
        gateway_args=GATEWAY_ARGS,
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        wait_synced(c.gateways[0].url, 2)
        wait_synced(c.gateways[1].url, 2)
        yield c


def test_predicted_cached_tokens_equal_reported(cluster):
    """Sequential multi-turn, multimodal traffic: the prediction is exact after events settle."""
    gw = cluster.gateway_url
    wl = Workload(WorkloadSpec(tenants=2, users_per_tenant=2, turns=3, system_words=200, seed=3))
    histories: dict[str, list[dict]] = {}
    exact = hits = n = 0
    for turn in wl:
        msgs = histories.setdefault(turn.conversation, wl.initial_messages(turn.tenant))
        msgs.append({"role": "user", "content": turn.content})
        r = chat(gw, msgs, **GREEDY)
        assert r.status_code == 200, r.text
        assert cluster.served_by(r) in cluster.worker_urls
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
        exact += predicted == cached
        hits += cached > 0
        n += 1
        msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        wait_index_converged(gw, cluster.worker_urls)  # the next turn sees this one's blocks
    assert exact / n >= 0.99, (exact, n)
    assert hits >= n // 2  # the workload does reuse prefixes: the equality is not vacuous
    metrics = httpx.get(f"{gw}/metrics").text
    assert "kvgate_reported_cached_tokens_total" in metrics


def test_two_gateways_hold_the_same_index_and_choose_alike(cluster):
    g0, g1 = (g.url for g in cluster.gateways)
    system = {"role": "system", "content": "You review pull requests. " * 60}
    first = chat(g0, [system, {"role": "user", "content": "first question"}], **GREEDY)
    assert first.status_code == 200
    # Both gateways' recomputed keys are exactly the keys in each worker's own snapshot.
    for g in (g0, g1):
        wait_index_converged(g, cluster.worker_urls)
    follow = [system, {"role": "user", "content": "second question"}]
    c0 = chat(g0, follow, **GREEDY).headers["x-kvgate-replica"]
    c1 = chat(g1, follow, **GREEDY).headers["x-kvgate-replica"]
    assert c0 == c1 == first.headers["x-kvgate-replica"]


def test_streaming_passthrough_and_usage(cluster):
    gw = cluster.gateway_url
    msgs = [{"role": "user", "content": "stream me a few tokens please"}]
    for include_usage in (False, True):
        body = {"model": "demo", "messages": msgs, "max_tokens": 6, "stream": True}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{gw}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            assert cluster.served_by(r) in cluster.worker_urls
            assert "x-kvgate-predicted-cached-tokens" in r.headers
            events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        usage_chunks = [c for c in chunks if c.get("usage")]
        assert bool(usage_chunks) == include_usage
        assert any(c["choices"] for c in chunks)


def test_completions_policy_override_and_models(cluster):
    gw = cluster.gateway_url
    seen = set()
    for i in range(4):
        r = httpx.post(
            f"{gw}/v1/completions",
            json={"model": "demo", "prompt": f"count {i}", "max_tokens": 2},
            headers={"x-kvgate-routing-policy": "round_robin"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        seen.add(cluster.served_by(r))
    assert seen == set(cluster.worker_urls)
    models = httpx.get(f"{gw}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["demo"]
    assert models["data"][0]["root"] == "demo"  # not the model's path on the worker
    assert httpx.get(f"{gw}/health").status_code == 200


def test_session_policy_is_sticky(cluster):
    gw = cluster.gateway_url
    hdr = {"x-kvgate-routing-policy": "session", "x-session-id": "user-42"}
    chosen = {
        chat(gw, user(f"turn {i}"), hdr, **GREEDY).headers["x-kvgate-replica"] for i in range(4)
    }
    assert len(chosen) == 1


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param"),
    [
        ("/v1/chat/completions", b"{not json", {}, 400, None),
        ("/v1/chat/completions", b'{"model": "demo"}', {}, 400, "messages"),
        ("/v1/chat/completions", b'{"messages": []}', {}, 400, "messages"),
        ("/v1/completions", b'{"prompt": 12}', {}, 400, "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}]}',
            {"x-kvgate-routing-policy": "fastest"},
            400,
            "x-kvgate-routing-policy",
        ),
        (
            "/v1/chat/completions",
            json.dumps(
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "image_url",
                                    "image_url": {"url": "data:image/png;base64,!!"},
                                }
                            ],
                        }
                    ]
                }
            ).encode(),
            {},
            400,
            None,
        ),
    ],
)
def test_bad_requests_get_openai_errors(cluster, path, body, headers, status, param):
    r = httpx.post(
        f"{cluster.gateway_url}{path}",
        content=body,
        headers={"content-type": "application/json", **headers},
        timeout=30,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert param in (err["param"] or "")


def test_gateway_import_leaves_torch_out():
    code = "import sys, gateway, gateway.app, gateway.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


class _ImageServer:
    """A real HTTP server with one PNG, counting fetches."""

    def __init__(self, png: bytes) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.hits = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits += 1
                self.send_response(200)
                self.send_header("content-type", "image/png")
                self.send_header("content-length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/cat.png"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_remote_image_fetched_once_inlined_and_keyed_alike(cluster):
    from harness.workload import make_image

    images = _ImageServer(make_image(77))
    try:
        msgs = [
            {"role": "system", "content": "You describe pictures carefully. " * 20},
            image_message(images.url, text="What is in this picture?"),
        ]
        first = chat(cluster.gateway_url, msgs, **GREEDY)
        assert first.status_code == 200, first.text
        assert images.hits == 1  # the gateway fetched it; the worker got it inline
        wait_index_converged(cluster.gateway_url, cluster.worker_urls)
        second = chat(cluster.gateway_url, msgs, **GREEDY)
        assert second.status_code == 200
        assert images.hits == 2
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert second.headers["x-kvgate-replica"] == first.headers["x-kvgate-replica"]
        assert int(second.headers["x-kvgate-predicted-cached-tokens"]) == cached
        # The image's 64 placeholder tokens are inside the cached prefix.
        assert cached > first.json()["usage"]["prompt_tokens"] - 16
    finally:
        images.close()
