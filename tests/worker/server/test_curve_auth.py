"""The KV events are no easier to read than the snapshot (issue 14, finding 1), on real sockets.

Anyone who reached a worker's ZMQ ports read every tenant's token ids. With a worker token the
worker's PUB and replay ROUTER are CURVE servers that admit only the client key derived from
the same token (cachekey.worker_auth, worker/server/curve_auth.py): a real worker process
publishes while subscribers without the key (no CURVE, keys from another token, the server's
public key with a key pair of their own) connect to it and receive nothing, and one with the
gateway's keys receives every batch.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx
import pytest
import zmq

from cachekey.events import REPLAY_END, seq_bytes
from cachekey.worker_auth import CurveKeys
from tests.support.worker_harness import WorkerProcess

pytestmark = pytest.mark.slow

TOKEN = "events-" + "9a8b7c6d5e4f30211203f4e5d6c7b8a9"
AS_GATEWAY = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def worker(demo_model_dir: Path):
    with WorkerProcess(demo_model_dir, env={"KVGATE_WORKER_TOKEN": TOKEN}) as w:
        yield w


def _keyed_as(keys: CurveKeys):
    return keys.connect


def _stolen_server_key(sock: zmq.Socket) -> None:
    """The server's public key (say, read off a gateway's config) with a key pair of one's own."""
    public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, CurveKeys.from_token(TOKEN).server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


CLIENTS = {
    "gateway": _keyed_as(CurveKeys.from_token(TOKEN)),
    "plain": lambda sock: None,
    "another token": _keyed_as(CurveKeys.from_token("another-token-" + "5" * 20)),
    "stolen server key": _stolen_server_key,
}


def _socket(ctx: zmq.Context, kind: int, who: str, port: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    CLIENTS[who](sock)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _store_blocks(worker: WorkerProcess, i: int) -> None:
    body = {"model": "demo", "max_tokens": 1, "prompt": f"tenant secret {i} " * 12}
    r = httpx.post(f"{worker.url}/v1/completions", json=body, headers=AS_GATEWAY, timeout=30)
    assert r.status_code == 200, r.text


def _drain(sock: zmq.Socket) -> int:
    n = 0
    while sock.poll(0, zmq.POLLIN):
        sock.recv_multipart()
        n += 1
    return n


def test_a_subscriber_without_the_key_receives_nothing(worker: WorkerProcess) -> None:
    ctx = zmq.Context()
    try:
        subs = {who: _socket(ctx, zmq.SUB, who, worker.events_port) for who in CLIENTS}
        got = dict.fromkeys(CLIENTS, 0)
        deadline = time.monotonic() + 60
        i = 0
        # Requests until the gateway's subscriber has seen 5 batches published after every
        # subscriber connected: each of the others had the same batches to read.
        while got["gateway"] < 5:
            assert time.monotonic() < deadline, got
            _store_blocks(worker, i)
            i += 1
            subs["gateway"].poll(200, zmq.POLLIN)
            for who, sub in subs.items():
                got[who] += _drain(sub)
        time.sleep(0.5)
        for who, sub in subs.items():
            got[who] += _drain(sub)
        assert got["gateway"] >= 5
        assert {who: n for who, n in got.items() if who != "gateway"} == {
            "plain": 0,
            "another token": 0,
            "stolen server key": 0,
        }
    finally:
        ctx.destroy(linger=0)
    # ZAP refused the one client that knew the server's key; it is logged once, keys never.
    log = worker.log()
    assert log.count("refused a client without the worker token's CURVE key") == 1
    assert TOKEN not in log


def test_replay_answers_only_the_gateway(worker: WorkerProcess) -> None:
    _store_blocks(worker, 1000)  # at least one batch in the replay buffer
    ctx = zmq.Context()
    try:
        dealers = {who: _socket(ctx, zmq.DEALER, who, worker.replay_port) for who in CLIENTS}
        for dealer in dealers.values():
            # Without a handshake there may be no pipe: then the request cannot even be queued.
            with contextlib.suppress(zmq.Again):
                dealer.send_multipart([b"", seq_bytes(0)], flags=zmq.NOBLOCK)
        good = dealers.pop("gateway")
        frames = []
        while True:
            assert good.poll(10_000, zmq.POLLIN), "the gateway's replay request got no answer"
            reply = good.recv_multipart()
            frames.append(reply)
            if reply == list(REPLAY_END):
                break
        assert len(frames) >= 2  # at least one batch, then the end marker
        time.sleep(1.0)  # as long again for the others' answers, if any were coming
        assert {who: d.poll(0, zmq.POLLIN) for who, d in dealers.items()} == dict.fromkeys(
            dealers, 0
        )
    finally:
        ctx.destroy(linger=0)


def test_the_worker_says_its_events_need_the_key(worker: WorkerProcess) -> None:
    info = httpx.get(f"{worker.url}/kvgate/info", headers=AS_GATEWAY, timeout=10).json()
    assert info["kv_events"]["curve"] is True
