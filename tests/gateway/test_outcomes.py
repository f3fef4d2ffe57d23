"""Every request is counted once, with its real outcome (real gateway, real sim worker, HTTP).

A refusal at any stage moves `kvgate_requests_total{replica="none"}` with the status the client
got; a worker's refusal is counted on that worker but predicts nothing (no predicted header, no
predicted tokens, no speculative entry); a client that leaves is `client_gone`, and the worker
stops its request (`vllm:num_requests_running` falls long before the request could end).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.prom import metric_by_labels, metric_total
from harness.waits import wait_until
from tests.support.chat import bearer, chat_body, post, user

KEY = "sk-outcomes-test-key-0001"
AUTH = bearer(KEY)
DECODE_S = 0.05  # per step: a 400-token answer takes 20 s, far longer than any wait below
LONG = 400
REQUESTS = "kvgate_requests_total"
PREDICTED = "kvgate_predicted_cached_tokens_total"
RUNNING = "vllm:num_requests_running"
PREDICTED_HEADER = "x-kvgate-predicted-cached-tokens"
GATEWAY_ARGS = (
    "--poll-interval", "0.2",
    "--tenant-salt-secret", "outcomes-test",
    "--max-body-bytes", "64KiB",
    "--max-inflight-per-replica", "1",  # one slot and no queue: a second request is shed
    "--max-queue", "0",
    "--request-timeout", "3",  # a whole answer of LONG tokens (20 s) is a 502 after 3 s
)  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("logs")
    keys = log_dir / "keys.txt"
    keys.write_text(f"{KEY} alice\n")
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=256,
        worker_args=("--sim-decode-s-per-step", str(DECODE_S)),
        gateway_args=(*GATEWAY_ARGS, "--api-keys-file", str(keys)),
        log_dir=log_dir,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        yield c


def _body(text: str, max_tokens: int = 4, **kw) -> dict:
    return chat_body(user(text), max_tokens=max_tokens, **kw)


def outcomes(c: Cluster) -> dict[tuple[str, ...], float]:
    return metric_by_labels(c.gateway_url, REQUESTS, "replica", "policy", "status")


def moved(before: dict, after: dict) -> dict[tuple[str, ...], float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def test_each_refusal_counts_once_with_its_status(cluster) -> None:
    c = cluster
    big = json.dumps(_body("x" * 70_000)).encode()
    cases = [
        ("401 no API key", 401, _body("hi"), {"authorization": ""}),
        ("400 invalid JSON", 400, b'{"model": "demo", "messages": [', None),
        ("413 body over --max-body-bytes", 413, big, None),
        ("400 max_tokens over --max-output-tokens", 400, _body("hi", max_tokens=10**6), None),
        ("400 temperature below 0", 400, _body("hi", temperature=-1), None),
        ("404 unknown model", 404, _body("hi", model="nope"), None),
        ("400 unknown policy", 400, _body("hi"), {"x-kvgate-routing-policy": "nope"}),
    ]
    for what, status, body, headers in cases:
        before, predicted = outcomes(c), metric_total(c.gateway_url, PREDICTED)
        r = post(c.gateway_url, body, headers={**AUTH, **(headers or {})})
        assert r.status_code == status, (what, r.text)
        assert r.json()["error"]["code"], what  # an OpenAI body with a code
        # replica "none", the default policy (an unknown name never becomes a label)
        assert moved(before, outcomes(c)) == {("none", "cache_aware", str(status)): 1.0}, what
        assert metric_total(c.gateway_url, PREDICTED) == predicted, what


def test_shed_when_full_counts_429(cluster) -> None:
    """One slot per replica and no queue: a second request while a stream holds it is shed."""
    c = cluster
    with httpx.stream(
        "POST",
        f"{c.gateway_url}/v1/chat/completions",
        json=_body("hold the only slot", max_tokens=LONG, ignore_eos=True, stream=True),
        headers=AUTH,
        timeout=30,
    ) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped iterator closes the stream (client gone)
        next(lines)
        before = outcomes(c)
        r = post(c.gateway_url, _body("no room"), headers=AUTH)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert moved(before, outcomes(c)) == {("none", "cache_aware", "429"): 1.0}


def test_worker_refusal_predicts_nothing(cluster) -> None:
    """The worker refuses logprobs: counted on it with its 400, but no prediction is counted or
    sent, and no speculative entry is left, so the same prompt served next predicts what the
    worker then reports (0), not the refused request's blocks."""
    c = cluster
    (worker,) = c.worker_urls
    text = "A prompt long enough to fill a few cache blocks of the demo model. " * 4
    before, predicted = outcomes(c), metric_total(c.gateway_url, PREDICTED)
    r = post(c.gateway_url, _body(text, logprobs=True), headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert c.served_by(r) == worker and PREDICTED_HEADER not in r.headers
    assert moved(before, outcomes(c)) == {(c.replica_name(worker), "cache_aware", "400"): 1.0}
    assert metric_total(c.gateway_url, PREDICTED) == predicted

    ok = post(c.gateway_url, _body(text), headers=AUTH)
    assert ok.status_code == 200, ok.text
    reported = ok.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert int(ok.headers[PREDICTED_HEADER]) == reported == 0
    assert metric_total(c.gateway_url, PREDICTED) == predicted + reported


def test_abandoned_stream_is_client_gone_and_stops_the_worker(cluster) -> None:
    c = cluster
    (worker,) = c.worker_urls
    before = outcomes(c)
    with httpx.stream(
        "POST",
        f"{c.gateway_url}/v1/chat/completions",
        json=_body("a long story, abandoned", max_tokens=LONG, ignore_eos=True, stream=True),
        headers=AUTH,
        timeout=30,
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert metric_total(worker, RUNNING) == 1
        left = time.monotonic()
    # The worker stops at once; running to the end would take LONG * DECODE_S = 20 s.
    took = wait_until(lambda: metric_total(worker, RUNNING) == 0, 5, "the worker to stop")
    assert time.monotonic() - left < 5 and took < 5
    wait_until(lambda: moved(before, outcomes(c)) != {}, 5, "the outcome")
    assert moved(before, outcomes(c)) == {
        (c.replica_name(worker), "cache_aware", "client_gone"): 1.0
    }


def test_abandoned_request_is_client_gone_and_stops_the_worker(cluster) -> None:
    """Not streamed: the gateway notices the client leave while it waits for the answer."""
    c = cluster
    (worker,) = c.worker_urls
    before, predicted = outcomes(c), metric_total(c.gateway_url, PREDICTED)
    body = _body("a long answer nobody waits for", max_tokens=LONG, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{c.gateway_url}/v1/chat/completions", json=body, headers=AUTH, timeout=1.5)
    wait_until(lambda: metric_total(worker, RUNNING) == 0, 5, "the worker to stop")
    wait_until(lambda: moved(before, outcomes(c)) != {}, 5, "the outcome")
    assert moved(before, outcomes(c)) == {
        (c.replica_name(worker), "cache_aware", "client_gone"): 1.0
    }
    assert metric_total(c.gateway_url, PREDICTED) == predicted
    # The slot came back: the next request is served, not shed.
    assert post(c.gateway_url, _body("after the abandoned one"), headers=AUTH).status_code == 200


def test_every_replica_failed_is_a_counted_502_naming_no_url(cluster) -> None:
    """The worker sends nothing for --request-timeout (a whole answer comes at its end): 502
    `upstream_failed`, naming the replica by its name, never its URL (docs/security.md)."""
    c = cluster
    (worker,) = c.worker_urls
    before = outcomes(c)
    body = _body("an answer slower than the timeout", max_tokens=LONG, ignore_eos=True)
    r = post(c.gateway_url, body, headers=AUTH)
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "upstream_failed", err
    assert c.replica_name(worker) in err["message"] and worker not in err["message"], err
    wait_until(lambda: metric_total(worker, RUNNING) == 0, 5, "the worker to stop")
    assert moved(before, outcomes(c))[("none", "cache_aware", "502")] == 1.0


def test_no_replica_is_a_counted_503(cluster) -> None:
    """Runs last: it stops the worker."""
    c = cluster
    c.workers[0].kill()
    wait_until(
        lambda: httpx.get(f"{c.gateway_url}/health", timeout=5).status_code == 503,
        10,
        "the gateway to see the worker gone",
    )
    before = outcomes(c)
    r = post(c.gateway_url, _body("nobody to serve it"), headers=AUTH)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
    assert moved(before, outcomes(c)) == {("none", "cache_aware", "503"): 1.0}
    # A model no worker served: still 503 while none is healthy, but not "no worker is
    # configured" (one is, and down).
    r = post(c.gateway_url, _body("for a model nobody serves", model="nope"), headers=AUTH)
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "configured" not in message and "none of the known workers" in message, message
