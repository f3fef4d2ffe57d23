"""Gateway-side faults over real processes: a gateway restart under load, and the Kubernetes API
going away and coming back while the gateway discovers its workers through EndpointSlices."""

from __future__ import annotations

import asyncio
import random
import signal

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.load import Tally, make_body, one_request, run_load
from harness.proc import Proc
from harness.prom import metric_total
from harness.waits import wait_index_converged, wait_until
from tests.support.k8s_fake_api import FakeApi, FakeApiServer, make_slice

pytestmark = [pytest.mark.slow, pytest.mark.long]

SIM_TIMING = ("--sim-prefill-s-per-token", "0.0002", "--sim-decode-s-per-step", "0.01")
# Refused connections (the gateway was down) and keep-alive connections closed or reset by the
# shutdown before the request was read: clear client-side errors, never a hang. The test proves
# these were never forwarded by counting what the workers served.
NOT_ACCEPTED = {"ConnectError", "RemoteProtocolError", "ReadError"}
SERVED = "vllm:e2e_request_latency_seconds_count"


def _served(c: Cluster) -> float:
    return sum(metric_total(url, SERVED) for url in c.worker_urls)


def _replicas(gateway: str) -> dict:
    return httpx.get(f"{gateway}/kvgate/index", timeout=5).json()["replicas"]


def _synced(gateway: str, urls: set[str]) -> bool:
    reps = _replicas(gateway)
    return set(reps) == urls and all(r["synced"] and r["healthy"] for r in reps.values())


def test_gateway_restart_under_load_rebuilds_index_from_snapshots(tmp_path):
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=256,
        gateway_args=("--poll-interval", "0.2"),
        worker_args=SIM_TIMING,
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        gw, proc = c.gateway_url, c.gateways[0]
        urls = set(c.worker_urls)
        wait_until(lambda: _synced(gw, urls), 15, "subscribers synced")
        assert asyncio.run(run_load(gw, 20, concurrency=8, seed=5)).ok == 20
        served_before = _served(c)

        async def scenario() -> tuple[Tally, int]:
            stop = asyncio.Event()
            tally = Tally()
            load = asyncio.create_task(_clients(gw, 8, stop, tally))
            await asyncio.sleep(1.0)
            # A graceful stop lets accepted requests finish; then the new process starts.
            await asyncio.to_thread(proc.kill, signal.SIGTERM)
            await asyncio.to_thread(proc.start)
            await asyncio.to_thread(proc.wait_healthy, 30)
            ok_at_restart = tally.ok
            await asyncio.sleep(1.5)
            stop.set()
            await load
            return tally, ok_at_restart

        tally, ok_at_restart = asyncio.run(scenario())
        assert "timeout" not in tally.lost_reasons  # nothing hangs
        assert set(tally.lost_reasons) <= NOT_ACCEPTED, tally.lost_reasons
        # A gateway that listens before its first poll answers 503 "no healthy worker" (its
        # /health is 503 too, so a readiness probe keeps traffic away): a clear error.
        assert set(tally.failed_reasons) <= {"503"}, tally.failed_reasons
        assert ok_at_restart > 0 and tally.ok > ok_at_restart  # served before and after
        # Every request a worker served reached its client: the gateway dropped none it forwarded.
        assert _served(c) - served_before == tally.ok

        # The new gateway has no history: its index comes from the workers' snapshots alone.
        wait_until(lambda: _synced(gw, urls), 15, "new gateway synced")
        assert any(r["blocks"] > 0 for r in _replicas(gw).values())
        wait_index_converged(gw, c.worker_urls)
        after = asyncio.run(run_load(gw, 20, concurrency=8, seed=7))
        assert after.ok == 20, (after.failed_reasons, after.lost_reasons)
        wait_index_converged(gw, c.worker_urls)

        # A hard kill: requests in flight get a clear connection error, and the next gateway
        # rebuilds the same index again.
        proc.kill(signal.SIGKILL)
        proc.start()
        proc.wait_healthy(30)
        wait_until(lambda: _synced(gw, urls), 15, "third gateway synced")
        wait_index_converged(gw, c.worker_urls)


async def _clients(gateway: str, n: int, stop: asyncio.Event, tally: Tally) -> None:
    """n clients sending requests until `stop`; like a real client, back off when refused."""
    url = f"{gateway}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=20) as client:

        async def loop(i: int) -> None:
            rng = random.Random(i)
            while not stop.is_set():
                body = make_body(rng, groups=6)
                body["stream"] = rng.random() < 0.25
                refused = tally.lost_reasons.get("ConnectError", 0)
                await one_request(client, url, body, tally)
                if tally.lost_reasons.get("ConnectError", 0) > refused:
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(loop(i) for i in range(n)))


def _slice(name: str, worker: Proc) -> dict:
    return make_slice(name, [("127.0.0.1", True)], http_port=worker.port)


def test_kubernetes_api_away_and_back(tmp_path, monkeypatch):
    spec = ClusterSpec(
        workers=3,
        engine="sim",
        num_blocks=256,
        gateways=0,  # started below, once the API server knows the workers
        gateway_args=(
            "--discovery",
            "k8s",
            "--k8s-namespace",
            "ns",
            "--k8s-service",
            "workers",
            "--poll-interval",
            "0.2",
        ),
        log_dir=tmp_path,
        startup_timeout=60,
    )
    api = FakeApi()
    with Cluster(spec) as c:
        w0, w1, w2 = c.workers
        api.put(_slice("w-0", w0))
        api.put(_slice("w-1", w1))
        server = FakeApiServer(api).__enter__()
        port = server.port
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(server.kubeconfig())
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        gw_proc = c.make_gateway(0)
        c.gateways = [gw_proc]
        gw_proc.start()
        try:
            gw_proc.wait_healthy(60)
            gw = gw_proc.url
            wait_until(lambda: _synced(gw, {w0.url, w1.url}), 15, "discovered w0, w1")

            # The API server goes away; meanwhile the Service's endpoints change.
            server.__exit__(None, None, None)
            api.delete("w-1")
            api.put(_slice("w-2", w2))
            # Routing goes on over the replicas the gateway already knows.
            during = asyncio.run(run_load(gw, 16, concurrency=8, stream_fraction=0.25, seed=8))
            assert during.ok == 16, (during.failed_reasons, during.lost_reasons)
            assert set(_replicas(gw)) == {w0.url, w1.url}

            # Back on the same port: the gateway follows the change it missed.
            server = FakeApiServer(api, port=port).__enter__()
            wait_until(lambda: _synced(gw, {w0.url, w2.url}), 30, "replica set follows")
            after = asyncio.run(run_load(gw, 16, concurrency=8, seed=9))
            assert after.ok == 16, (after.failed_reasons, after.lost_reasons)
            wait_index_converged(gw, [w0.url, w2.url])
        finally:
            server.__exit__(None, None, None)
