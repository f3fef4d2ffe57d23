"""Overload: a tiny in-flight bound and queue in front of a slow sim worker.

Past the bound and the queue, requests get 429 + Retry-After with an OpenAI body; every admitted
request completes; queued requests are served once a slot frees; slots held by streams come back.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from tests.support.chat import chat_body, post, user

DECODE_S = 0.15
TOKENS = 12  # ~1.8 s per request on the sim worker


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=256,
        worker_args=("--sim-decode-s-per-step", str(DECODE_S)),
        gateway_args=(
            "--poll-interval",
            "0.2",
            "--max-inflight-per-replica",
            "2",
            "--max-queue",
            "2",
            "--queue-timeout",
            "10",
        ),
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        yield c.gateway_url


def _body(i: int, stream: bool = False) -> dict:
    return chat_body(
        user(f"request number {i}"),
        max_tokens=TOKENS,
        ignore_eos=True,
        temperature=0.0,
        stream=stream,
    )


def _burst(gw: str, n: int) -> list[httpx.Response]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: post(gw, _body(i)), range(n)))


def test_burst_past_bound_and_queue_gets_429(cluster) -> None:
    results = _burst(cluster, 7)
    ok = [r for r in results if r.status_code == 200]
    refused = [r for r in results if r.status_code == 429]
    assert len(ok) + len(refused) == 7, [r.text for r in results]
    # 2 in flight + 2 queued are served; the other 3 are refused at once.
    assert len(ok) == 4 and len(refused) == 3, [r.status_code for r in results]
    for r in ok:  # every admitted request completes in full
        assert r.json()["usage"]["completion_tokens"] == TOKENS
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and "--max-queue" in err["message"]


def test_queue_timeout_gives_429(tmp_path) -> None:
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=128,
        worker_args=("--sim-decode-s-per-step", str(DECODE_S)),
        gateway_args=("--max-inflight-per-replica", "1", "--queue-timeout", "0.3"),
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        results = _burst(c.gateway_url, 3)
        codes = sorted(r.status_code for r in results)
        assert codes == [200, 429, 429], [r.text for r in results]
        timed_out = [r for r in results if r.status_code == 429]
        assert all("--queue-timeout" in r.json()["error"]["message"] for r in timed_out)
        assert "retry-after" in timed_out[0].headers


def test_streams_release_their_slots(cluster) -> None:
    for i in range(3):  # three streams one after another through a bound of 2
        with httpx.stream(
            "POST", f"{cluster}/v1/chat/completions", json=_body(100 + i, True), timeout=60
        ) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert all("error" not in json.loads(ln[6:]) for ln in lines[:-1])
    # Had any slot leaked, this burst would see fewer than 4 admitted.
    codes = sorted(r.status_code for r in _burst(cluster, 4))
    assert codes == [200] * 4


def test_admission_unit_bounds_and_handoff() -> None:
    import asyncio

    from gateway.config import GatewayConfig
    from gateway.errors import Overloaded
    from gateway.fleet.replica import Replica
    from gateway.names import ReplicaId
    from gateway.routing.admission import Admission

    async def scenario() -> None:
        cfg = GatewayConfig(max_inflight_per_replica=1, max_queue=1, queue_timeout=5.0)
        adm = Admission(cfg)
        a, b = Replica(ReplicaId("a"), "http://a"), Replica(ReplicaId("b"), "http://b")
        await adm.admit([a, b])
        await adm.admit([a, b])  # two free slots: two claims
        assert adm.pending == 2
        assert await adm.place([a, b]) is a
        assert await adm.place([a, b]) is b  # the next best with room
        assert (a.in_flight, b.in_flight, adm.pending) == (1, 1, 0)
        waiter = asyncio.create_task(adm.admit([a, b]))  # no room: waits before any render
        await asyncio.sleep(0.01)
        assert adm.waiting == 1 and not waiter.done()
        with pytest.raises(Overloaded, match="--max-queue"):
            await adm.admit([a])  # the queue (1) is full: refused at once
        adm.release(b)
        await asyncio.wait_for(waiter, 1.0)
        assert await adm.place([a, b]) is b
        # A retry moves the slot: b's is freed, a has no room, so none is taken.
        assert adm.move(b, [a]) is None and b.in_flight == 0
        adm.release(a)
        assert (a.in_flight, b.in_flight, adm.pending, adm.waiting) == (0, 0, 0, 0)

    asyncio.run(scenario())


def test_claims_count_against_free_slots() -> None:
    """Requests admitted but still rendering hold their claim: no more pass than slots exist."""
    import asyncio

    from gateway.config import GatewayConfig
    from gateway.errors import Overloaded
    from gateway.fleet.replica import Replica
    from gateway.names import ReplicaId
    from gateway.routing.admission import Admission

    async def scenario() -> None:
        cfg = GatewayConfig(max_inflight_per_replica=2, max_queue=0, queue_timeout=1.0)
        adm = Admission(cfg)
        a = Replica(ReplicaId("a"), "http://a")
        await adm.admit([a])
        await adm.admit([a])
        with pytest.raises(Overloaded):
            await adm.admit([a])  # both slots claimed by requests not yet placed
        adm.withdraw()  # one failed while rendering: its claim is free again
        await adm.admit([a])
        assert adm.pending == 2 and a.in_flight == 0

    asyncio.run(scenario())


def test_full_render_queue_gives_429() -> None:
    import asyncio
    import threading

    from gateway.errors import Overloaded, error_response
    from gateway.routing.admission import RenderQueue

    async def scenario() -> None:
        q = RenderQueue(threads=1, max_queue=2)
        gate = threading.Event()
        try:
            running = [asyncio.create_task(q.run(gate.wait, 5)) for _ in range(2)]
            await asyncio.sleep(0.01)
            with pytest.raises(Overloaded) as info:
                await q.run(gate.wait, 5)
            resp = error_response(info.value)
            assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
            err = json.loads(resp.body)["error"]
            assert err["type"] == "rate_limit_error" and "render queue" in err["message"]
            gate.set()
            assert await asyncio.gather(*running) == [True, True]
            assert q.queued == 0
        finally:
            gate.set()
            q.close()

    asyncio.run(scenario())
