"""Gateway peers: two real gateway processes on 127.0.0.1 sharing placements and in-flight load
over CURVE-secured ZMQ (gateway/peers/).

The gateways run without the workers' KV events (`--no-kv-events`), so the only way gateway B
can predict a hit for a prefix gateway A routed is A's placement, and the only way B can know
A's requests hold the replicas' slots is A's load.
"""

from __future__ import annotations

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import zmq

from cachekey.headers import PREDICTED_HEADER
from cachekey.worker_auth import CurveKeys
from gateway.peers.wire import PLACED, RELEASED, decode
from harness.cluster import Cluster, ClusterSpec
from tests.support.chat import chat_body, post, user

TOKEN = "peer-test-token-0123456789"
DECODE_S = 0.15
SLOW_TOKENS = 16  # ~2.4 s on the sim worker: long enough to be seen in flight
PEER_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=2,
        gateways=2,
        peers=True,
        engine="sim",
        num_blocks=256,
        worker_token=TOKEN,
        worker_args=("--sim-decode-s-per-step", str(DECODE_S)),
        gateway_args=(
            "--poll-interval",
            "0.2",
            "--no-kv-events",
            "--max-inflight-per-replica",
            "1",
            "--max-queue",
            "0",
            "--peer-timeout",
            str(PEER_TIMEOUT),
            # The load the peers count, alone: with a cap of 1 on 2 replicas, the shares on top
            # (tests/gateway/test_peer_share_cap.py) would give each gateway one replica.
            "--peer-admission",
            "counted",
        ),
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=90,
    )
    with Cluster(spec) as c:
        yield c


def _metric(gw: str, name: str) -> dict[str, float]:
    """label text -> value of every sample of `name` on a gateway's /metrics."""
    text = httpx.get(f"{gw}/metrics", timeout=5).text
    pat = re.compile(rf"^{name}(\{{[^}}]*\}})? (\S+)$", re.M)
    return {m.group(1) or "": float(m.group(2)) for m in pat.finditer(text)}


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


def _slow(i: int) -> dict:
    return chat_body(user(f"slow request {i}"), max_tokens=SLOW_TOKENS, ignore_eos=True)


def _fill_from(gw: str, pool: ThreadPoolExecutor):
    """Two slow requests through `gw`: one on each replica (the cap is 1)."""
    return [pool.submit(post, gw, _slow(i)) for i in range(2)]


def _busy(gw: str) -> bool:
    return sum(_metric(gw, "kvgate_in_flight_requests").values()) == 2


def test_placement_reaches_the_peer(cluster: Cluster) -> None:
    a, b = (g.url for g in cluster.gateways)
    text = " ".join(f"word{i}" for i in range(300))  # many blocks: a prefix to predict
    body = chat_body(user(text), max_tokens=2)
    applied = sum(_metric(b, "kvgate_peer_placements_applied_total").values())
    first = post(a, body)
    assert first.status_code == 200, first.text
    assert int(first.headers[PREDICTED_HEADER]) == 0  # cold everywhere
    # placed, then released (a whole answer shows its keys as it ends): two changes at B
    _wait(
        lambda: sum(_metric(b, "kvgate_peer_placements_applied_total").values()) >= applied + 2,
        3,
        "A's placement applied at B",
    )
    second = post(b, body)
    assert second.status_code == 200, second.text
    assert cluster.served_by(second) == cluster.served_by(first)
    # B never routed this prefix and has no worker events: the hit is A's placement.
    assert int(second.headers[PREDICTED_HEADER]) > 0
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_in_flight_cap_holds_across_gateways(cluster: Cluster) -> None:
    a, b = (g.url for g in cluster.gateways)
    with ThreadPoolExecutor(2) as pool:
        held = _fill_from(a, pool)
        _wait(lambda: _busy(b), 3, "A's two requests counted at B")
        refused = post(b, _slow(9))  # both replicas hold A's requests: none has room
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert all(f.result().status_code == 200 for f in held)
    # A's load goes down at B with A's next batch: B admits again.
    _wait(lambda: not _busy(b), 2, "A's load released at B")
    assert post(b, chat_body(user("after"), max_tokens=2)).status_code == 200


def test_only_the_same_token_hears_the_peers(cluster: Cluster) -> None:
    ctx = zmq.Context()
    port = cluster.peer_ports[0]
    try:
        keyed, bare = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
        CurveKeys.from_token(TOKEN).connect(keyed)
        for s in (keyed, bare):
            s.setsockopt(zmq.LINGER, 0)
            s.subscribe(b"")
            s.connect(f"tcp://127.0.0.1:{port}")
        assert keyed.poll(3000), "a peer with the token's keys hears A's heartbeat"
        batch = decode(keyed.recv())
        assert batch.seq > 0 and isinstance(batch.load, dict)
        assert not bare.poll(1000), "a SUB without the CURVE keys heard the peers"
    finally:
        ctx.destroy(linger=0)


def test_a_placement_on_a_deferring_worker_is_placed_and_released_never_shown(
    cluster: Cluster,
) -> None:
    """A kvgate worker defers a request sharing a prefix being computed, so a guess about it is
    a hit at once, at the sender and at every peer alike: the sender's SHOWN would change
    nothing at a peer, and is not sent."""
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        CurveKeys.from_token(TOKEN).connect(sub)
        sub.setsockopt(zmq.LINGER, 0)
        sub.subscribe(b"")
        sub.connect(f"tcp://127.0.0.1:{cluster.peer_ports[0]}")
        assert sub.poll(3000), "A's heartbeat"
        a = cluster.gateways[0].url
        assert post(a, chat_body(user("shown at once"), max_tokens=2)).status_code == 200
        ops: dict[int, list[int]] = {}
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not any(len(v) > 1 for v in ops.values()):
            if sub.poll(100):
                for p in decode(sub.recv()).placements:
                    ops.setdefault(p.id, []).append(p.op)
        assert [v for v in ops.values() if v[0] == PLACED] == [[PLACED, RELEASED]], ops
    finally:
        ctx.destroy(linger=0)


def test_dead_peer_load_expires_and_a_restarted_one_rejoins(cluster: Cluster) -> None:
    a, b = (g.url for g in cluster.gateways)
    pool = ThreadPoolExecutor(2)
    _fill_from(a, pool)
    _wait(lambda: _busy(b), 3, "A's two requests counted at B")
    assert _metric(b, "kvgate_peers_up")[""] == 1
    cluster.gateways[0].kill(signal.SIGKILL)
    pool.shutdown(wait=True)  # A's clients see their connection drop
    _wait(lambda: not _busy(b), PEER_TIMEOUT + 1.5, "a dead peer's load expired at B")
    assert _metric(b, "kvgate_peers_up")[""] == 0
    assert post(b, chat_body(user("while A is down"), max_tokens=2)).status_code == 200
    cluster.gateways[0].start()
    cluster.gateways[0].wait_healthy(60)
    _wait(lambda: _metric(b, "kvgate_peers_up")[""] == 1, 3, "the restarted A is B's peer")
    assert post(a, chat_body(user("A is back"), max_tokens=2)).status_code == 200
