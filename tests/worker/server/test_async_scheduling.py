"""A live torch worker with --async-scheduling against one without: the same answers over HTTP
(streamed and not, images, stop strings, cache_salt, seeded n=2, usage), the same KV events over
ZMQ; a client that leaves mid-stream frees its request and the worker stays healthy."""

from __future__ import annotations

import json

import httpx
import pytest
import zmq

from cachekey.events import decode_batch, parse_replay_reply, seq_bytes
from harness.waits import wait_until
from harness.workload import data_url
from tests.support.engine import png_bytes
from tests.support.worker_harness import WorkerProcess

ARGS = ("--device", "cpu", "--num-blocks", "48", "--max-num-seqs", "4")
TEXT = "Paged attention keeps the KV cache in fixed-size blocks. " * 4
IMAGE = data_url(png_bytes(21))


@pytest.fixture(scope="module")
def workers(demo_model_dir):
    with (
        WorkerProcess(demo_model_dir, *ARGS, engine="torch") as sync,
        WorkerProcess(demo_model_dir, *ARGS, "--async-scheduling", engine="torch") as overlapped,
    ):
        yield sync, overlapped


def _chat(content: object, **fields: object) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": content}], **fields}


BODIES = [
    ("/v1/chat/completions", _chat(TEXT, max_tokens=24, temperature=0)),
    ("/v1/chat/completions", _chat(TEXT, max_tokens=24, temperature=0)),  # a prefix hit
    (
        "/v1/chat/completions",
        _chat(
            [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": IMAGE}},
            ],
            max_tokens=12,
            temperature=0,
        ),
    ),
    (
        "/v1/completions",
        {"model": "demo", "prompt": TEXT, "max_tokens": 30, "stop": [" the"], "temperature": 0},
    ),
    ("/v1/chat/completions", _chat(TEXT, max_tokens=10, temperature=0, cache_salt="tenant-b")),
    ("/v1/completions", {"model": "demo", "prompt": TEXT, "max_tokens": 16, "n": 2, "seed": 9}),
]


def _answer(url: str, path: str, body: dict, stream: bool) -> object:
    body = {**body, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", url + path, json=body, timeout=60) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line[6:12] == '{"id"']
        return [(c.get("choices"), c.get("usage")) for c in chunks]
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return (r.json()["choices"], r.json()["usage"])


def _events(port: int) -> list:
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart([b"", seq_bytes(0)])
    events = []
    try:
        while True:
            assert dealer.poll(5000), "no replay answer"
            item = parse_replay_reply(dealer.recv_multipart())
            if item is None:
                return events
            events += decode_batch(item[1]).events
    finally:
        dealer.close(linger=0)


def test_same_answers_and_events_as_the_synchronous_worker(workers) -> None:
    sync, overlapped = workers
    for i, (path, body) in enumerate(BODIES):
        stream = i % 2 == 1  # the hit, the stop string and n=2 streamed
        assert _answer(overlapped.url, path, body, stream) == _answer(
            sync.url, path, body, stream
        ), (path, body, stream)
    events = _events(sync.replay_port)
    assert len(events) > 10
    assert _events(overlapped.replay_port) == events
    snap = httpx.get(sync.url + "/kv/snapshot").json()["blocks"]
    assert httpx.get(overlapped.url + "/kv/snapshot").json()["blocks"] == snap


def _running(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:num_requests_running not exported")


def test_a_client_leaving_mid_stream_frees_its_request(workers) -> None:
    overlapped = workers[1]
    body = {"model": "demo", "prompt": "tell a long story", "max_tokens": 2000, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", overlapped.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    wait_until(lambda: _running(overlapped.url) == 0, 10)
    assert httpx.get(overlapped.url + "/health").status_code == 200
    path, body = BODIES[0]
    assert _answer(overlapped.url, path, body, False) == _answer(workers[0].url, path, body, False)
