"""Worker faults over real processes: SIGKILL under load, restart, dead engine, stalled engine.

Each test runs `python -m worker --engine sim` processes and `python -m gateway` on 127.0.0.1 and
checks three things: every request is accounted for (a non-streamed one succeeds, possibly after
a retry, or fails with a clear error; a stream ends with [DONE]), nothing outlives the configured
timeouts, and the gateway's index ends equal to the workers' `/kv/snapshot`s.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.load import Tally, hold_one_per_worker, run_load
from harness.prom import metric_total
from harness.waits import wait_index_converged, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.long]

SIM_TIMING = ("--sim-prefill-s-per-token", "0.0002", "--sim-decode-s-per-step", "0.01")


def _index(gateway: str) -> dict:
    return httpx.get(f"{gateway}/kvgate/index", timeout=5).json()["replicas"]


def _all_synced(gateway: str) -> bool:
    return all(r["synced"] for r in _index(gateway).values())


def _assert_accounted(tally: Tally, *, max_latency: float) -> None:
    """Nothing lost; the only failures are clear in-band stream errors (ended by [DONE])."""
    assert tally.lost == 0, tally.lost_reasons
    assert set(tally.failed_reasons) <= {"stream error event"}, tally.failed_reasons
    assert tally.ok > 0
    assert max(tally.latencies) < max_latency, max(tally.latencies)


def test_sigkill_worker_under_load(tmp_path):
    spec = ClusterSpec(
        workers=3,
        engine="sim",
        num_blocks=256,
        gateway_args=("--poll-interval", "0.2", "--retries", "2"),
        worker_args=SIM_TIMING,
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        gw, victim = c.gateway_url, c.workers[0]
        wait_until(lambda: _all_synced(gw), 15, "subscribers synced")

        async def scenario() -> tuple[Tally, Tally]:
            held = await hold_one_per_worker(gw, c.worker_urls)  # one is sure to need a retry
            load = asyncio.create_task(run_load(gw, 90, concurrency=12, stream_fraction=0.3))
            await asyncio.sleep(0.8)
            victim.kill(signal.SIGKILL)
            return await held, await load

        held, tally = asyncio.run(scenario())
        assert held.ok == 3, (held.failed_reasons, held.lost_reasons)
        _assert_accounted(tally, max_latency=20)
        assert metric_total(gw, "kvgate_retries_total") >= 1  # the victim's held request
        # The dead worker's entries vanish; the others equal their snapshots.
        wait_until(lambda: _index(gw)[victim.url]["blocks"] == 0, 10, "victim entries dropped")
        assert not _index(gw)[victim.url]["healthy"]
        survivors = [w.url for w in c.workers[1:]]
        wait_index_converged(gw, survivors)
        # Traffic goes on without the dead worker: nothing fails any more.
        after = asyncio.run(run_load(gw, 20, concurrency=8, stream_fraction=0.3, seed=1))
        assert after.ok == 20, (after.failed_reasons, after.lost_reasons)


def test_worker_restart_new_instance_reloads_snapshot(tmp_path):
    # A slow poll, so the restarted worker already holds blocks when the gateway notices it:
    # the new subscriber must take them from the snapshot, not from events.
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=256,
        gateway_args=("--poll-interval", "1.5"),
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        gw, w = c.gateway_url, c.workers[0]
        wait_until(lambda: _all_synced(gw), 15, "subscribers synced")
        assert asyncio.run(run_load(gw, 12, concurrency=4, stream_fraction=0)).ok == 12
        wait_index_converged(gw, c.worker_urls)
        old_instance = _index(gw)[w.url]["instance_id"]
        resyncs = metric_total(gw, "kvgate_event_resyncs_total")

        w.kill(signal.SIGTERM)
        w.start()
        w.wait_healthy(60)
        # Straight to the new instance, not through the gateway.
        body = {"model": "demo", "prompt": "restarted worker warm-up " * 20, "max_tokens": 2}
        for _ in range(3):
            assert httpx.post(f"{w.url}/v1/completions", json=body, timeout=10).status_code == 200
        new_instance = httpx.get(f"{w.url}/kvgate/info").json()["instance_id"]
        assert new_instance != old_instance

        wait_until(lambda: _index(gw)[w.url]["instance_id"] == new_instance, 15, "new instance")
        wait_until(lambda: _all_synced(gw), 15, "new subscriber synced")
        wait_index_converged(gw, c.worker_urls)
        assert _index(gw)[w.url]["blocks"] > 0
        assert metric_total(gw, "kvgate_event_resyncs_total") > resyncs
        assert asyncio.run(run_load(gw, 12, concurrency=4, seed=2)).ok == 12
        wait_index_converged(gw, c.worker_urls)


def test_dead_engine_behind_live_http_is_routed_around(tmp_path):
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=256,
        gateway_args=("--poll-interval", "0.2", "--retries", "2"),
        worker_args=(*SIM_TIMING, "--enable-fault-injection"),
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        gw, dead, alive = c.gateway_url, c.workers[0], c.workers[1]
        wait_until(lambda: _all_synced(gw), 15, "subscribers synced")

        async def scenario() -> Tally:
            load = asyncio.create_task(
                run_load(
                    gw,
                    60,
                    concurrency=8,
                    stream_fraction=0.3,
                    headers={"x-kvgate-routing-policy": "round_robin"},
                )
            )
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient() as client:
                r = await client.post(f"{dead.url}/debug/fault", params={"kind": "crash_engine"})
                assert r.status_code == 200
            return await load

        tally = asyncio.run(scenario())
        _assert_accounted(tally, max_latency=20)
        # The HTTP layer is up but the engine is not: /health says so and the gateway listens.
        assert httpx.get(f"{dead.url}/health").status_code == 503
        assert httpx.get(f"{dead.url}/kvgate/info").status_code == 200
        wait_until(lambda: not _index(gw)[dead.url]["healthy"], 5, "dead worker unhealthy")
        after = asyncio.run(
            run_load(gw, 16, concurrency=8, stream_fraction=0.3, seed=3, headers={})
        )
        assert after.ok == 16, (after.failed_reasons, after.lost_reasons)
        wait_index_converged(gw, [alive.url])


def test_stalled_worker_hits_gateway_timeout_and_is_retried(tmp_path):
    request_timeout = 2.0
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=256,
        # The worker's own watchdog is slower than the gateway's timeout, so the gateway's fires.
        gateway_args=(
            "--poll-interval",
            "0.2",
            "--retries",
            "1",
            "--request-timeout",
            str(request_timeout),
        ),
        worker_args=("--enable-fault-injection", "--engine-stall-timeout", "6"),
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        gw, stalled, alive = c.gateway_url, c.workers[0], c.workers[1]
        wait_until(lambda: _all_synced(gw), 15, "subscribers synced")
        r = httpx.post(f"{stalled.url}/debug/fault", params={"kind": "stall_engine"})
        assert r.status_code == 200

        t0 = time.monotonic()
        tally = asyncio.run(
            run_load(
                gw,
                12,
                concurrency=12,
                stream_fraction=0.3,
                headers={"x-kvgate-routing-policy": "round_robin"},
            )
        )
        took = time.monotonic() - t0
        # Each request waits at most one gateway timeout on the stalled worker, then retries.
        _assert_accounted(tally, max_latency=request_timeout * 2 + 3)
        assert tally.ok == 12
        assert took < request_timeout * 2 + 5
        assert metric_total(gw, "kvgate_retries_total") >= 1
        # Past its stall timeout the worker's /health fails and the gateway stops routing to it.
        wait_until(lambda: httpx.get(f"{stalled.url}/health").status_code == 503, 10, "503")
        wait_until(lambda: not _index(gw)[stalled.url]["healthy"], 5, "stalled unhealthy")
        retries = metric_total(gw, "kvgate_retries_total")
        after = asyncio.run(run_load(gw, 8, concurrency=8, seed=4))
        assert after.ok == 8
        # No detour through the stalled worker any more.
        assert metric_total(gw, "kvgate_retries_total") == retries
        wait_index_converged(gw, [alive.url])
