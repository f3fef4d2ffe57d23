"""KubernetesDiscovery driven through the real `kubernetes` client against a local API server."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import pytest

from gateway.discovery.endpoints import WorkerEndpoint
from gateway.discovery.k8s import (
    KubernetesDiscovery,
    build_selector,
    default_namespace,
    endpoint_urls,
    worker_endpoints,
)
from gateway.discovery.list_watch import Backoff
from tests.support.discovery import WAIT_S, Recorder
from tests.support.k8s_fake_api import FakeApi, FakeApiServer, make_slice
from tests.support.waits import until


def url(ip: str) -> str:
    return f"http://{ip}:8000"


def test_endpoint_urls_ready_only_and_named_port() -> None:
    sl = make_slice("a", [("10.0.0.1", True), ("10.0.0.2", None), ("10.0.0.3", False)])
    assert endpoint_urls([sl], "http") == {url("10.0.0.1"), url("10.0.0.2")}
    assert endpoint_urls([sl], "kv-events") == {"http://10.0.0.1:5557", "http://10.0.0.2:5557"}
    assert endpoint_urls([sl], "metrics") == frozenset()
    v6 = make_slice("b", [("fd00::7", True)])
    v6["addressType"] = "IPv6"
    assert endpoint_urls([v6], "http") == {"http://[fd00::7]:8000"}
    fqdn = make_slice("c", [("w-0.workers", True)])
    fqdn["addressType"] = "FQDN"
    assert endpoint_urls([fqdn], "http") == frozenset()
    empty = make_slice("d", [])
    empty["endpoints"] = None  # what the API sends for a Service with no pods
    assert endpoint_urls([empty], "http") == frozenset()


def test_worker_endpoints_carry_each_slices_kv_ports_and_pod() -> None:
    """A plain vLLM worker's events ports come from its slice's named ports; the pod from the
    endpoint's targetRef (for a topic naming {pod})."""
    sl = make_slice("a", [("10.0.0.1", True), ("10.0.0.2", True)])
    sl["ports"].append({"name": "kv-replay", "port": 5657, "protocol": "TCP"})
    sl["endpoints"][0]["targetRef"] = {"kind": "Pod", "name": "vllm-0", "namespace": "ns"}
    other = make_slice("b", [("10.0.0.3", True)], http_port=9000)
    other["ports"] = [p for p in other["ports"] if p["name"] == "http"]  # no events ports
    got = {w.url: w for w in worker_endpoints([sl, other], "http")}
    first = got[url("10.0.0.1")]
    assert (first.kv_events_port, first.kv_replay_port) == (5557, 5657)
    assert got[url("10.0.0.1")].pod == "vllm-0" and got[url("10.0.0.2")].pod is None
    assert got["http://10.0.0.3:9000"] == WorkerEndpoint("http://10.0.0.3:9000")
    named = worker_endpoints([sl], "http", "events", "replay")  # other names: none found
    assert {(w.kv_events_port, w.kv_replay_port) for w in named} == {(None, None)}


def test_selector_and_config_validation() -> None:
    assert build_selector(None, "kvgate-worker") == "kubernetes.io/service-name=kvgate-worker"
    assert build_selector("app=w", "s") == "app=w,kubernetes.io/service-name=s"
    with pytest.raises(ValueError):
        build_selector(None, None)
    with pytest.raises(ValueError):
        KubernetesDiscovery("ns", "app=w", watch_timeout_s=0)
    assert KubernetesDiscovery(None, "app=w").namespace == default_namespace()
    with pytest.raises(ValueError):
        Backoff(initial_s=2.0, max_s=1.0)


def test_backoff_grows_is_capped_and_jittered() -> None:
    b = Backoff(initial_s=0.1, max_s=1.0)
    delays = [b.next_delay() for _ in range(10)]
    assert 0.05 <= delays[0] <= 0.1
    assert all(0.5 <= d <= 1.0 for d in delays[5:])
    assert len(set(delays)) > 1
    b.reset()
    assert b.next_delay() <= 0.1


def test_discovery_follows_list_watch_410_and_drops(tmp_path: Path) -> None:
    api = FakeApi()
    api.put(make_slice("w-a", [("10.0.0.1", True), ("10.0.0.2", None), ("10.0.0.3", False)]))
    # Another Service's slice in the same namespace must be ignored.
    api.put(make_slice("other-x", [("10.9.9.9", True)], service="other"))
    with FakeApiServer(api) as server:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(server.kubeconfig())
        disc = KubernetesDiscovery(
            "ns",
            None,
            kubeconfig=str(kubeconfig),
            service="workers",
            backoff_initial_s=0.05,
            backoff_max_s=0.2,
        )
        asyncio.run(_scenario(api, disc))
        # Cancelling run() stops the watch thread too (its blocked read is cut).
        deadline = time.monotonic() + WAIT_S
        while any(t.name.startswith("kvgate-k8s-") for t in threading.enumerate()):
            assert time.monotonic() < deadline, "discovery thread still running"
            time.sleep(0.05)


async def _scenario(api: FakeApi, disc: KubernetesDiscovery) -> None:
    rec = Recorder()
    list_rv = str(api.rv)
    task = asyncio.create_task(disc.run(rec))
    try:
        # Initial list: ready or unset readiness only.
        await rec.until({url("10.0.0.1"), url("10.0.0.2")})
        assert api.lists()[0].label_selector == "kubernetes.io/service-name=workers"
        await until(lambda: len(api.watches()) == 1, "the first watch", WAIT_S)
        # A list is a fresh read; the watch starts at the version the list answered with.
        assert api.lists()[0].resource_version is None
        assert api.watches()[0].resource_version == list_rv

        # ADDED: a second slice of the same Service.
        api.put(make_slice("w-b", [("10.0.1.1", True)]))
        await rec.until({url("10.0.0.1"), url("10.0.0.2"), url("10.0.1.1")})

        # MODIFIED: readiness flips both ways.
        api.put(make_slice("w-a", [("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.3", True)]))
        await rec.until({url("10.0.0.1"), url("10.0.0.3"), url("10.0.1.1")})

        # A dropped connection: reconnect and resume from the last version, no relist.
        seen_rv = str(api.rv)
        lists_before = len(api.lists())
        watches_before = len(api.watches())
        api.drop()
        await until(lambda: len(api.watches()) > watches_before, "a reconnect", WAIT_S)
        api.put(make_slice("w-b", [("10.0.1.1", True), ("10.0.1.2", True)]))
        await rec.until({url("10.0.0.1"), url("10.0.0.3"), url("10.0.1.1"), url("10.0.1.2")})
        assert api.watches()[watches_before].resource_version == seen_rv
        assert len(api.lists()) == lists_before

        # 410 Gone: a change made while history was compacted is only seen by relisting.
        api.delete("w-b", quietly=True)
        api.expire()
        await rec.until({url("10.0.0.1"), url("10.0.0.3")})
        assert len(api.lists()) == lists_before + 1

        # DELETED after the relist: the watch resumed from the relist's version.
        api.put(make_slice("w-c", [("10.0.2.1", True)]))
        await rec.until({url("10.0.0.1"), url("10.0.0.3"), url("10.0.2.1")})
        api.delete("w-a")
        await rec.until({url("10.0.2.1")})

        # Every emission is a real change.
        assert all(a != b for a, b in zip(rec.sets, rec.sets[1:], strict=False))
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_discovery_retries_until_api_server_appears(tmp_path: Path) -> None:
    """An unreachable API server is retried with backoff; the set arrives once it is up."""
    api = FakeApi()
    api.put(make_slice("w-a", [("10.0.0.1", True)]))
    server = FakeApiServer(api)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(server.kubeconfig())
    port = server.port
    server.httpd.server_close()  # the port is known but nothing listens yet

    async def scenario() -> None:
        rec = Recorder()
        disc = KubernetesDiscovery(
            "ns",
            "app.kubernetes.io/component=worker",
            kubeconfig=str(kubeconfig),
            backoff_initial_s=0.05,
            backoff_max_s=0.2,
        )
        task = asyncio.create_task(disc.run(rec))
        await asyncio.sleep(0.5)
        assert rec.sets == []
        with FakeApiServer(api, port=port):
            await rec.until(set())  # the selector matches no slice: an empty set is emitted
            api.put(
                make_slice(
                    "w-b",
                    [("10.0.3.1", True)],
                    labels={"app.kubernetes.io/component": "worker"},
                )
            )
            await rec.until({url("10.0.3.1")})
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(scenario())


def test_cut_ends_a_quiet_watch_and_one_still_opening(tmp_path: Path) -> None:
    """A watch with nothing to say blocks in a read; `cut()` must end it at once, also when it
    runs while the watch request is still on its way (the thread then shuts it itself)."""
    api = FakeApi()
    api.put(make_slice("w-a", [("10.0.0.1", True)], service="workers"))
    with FakeApiServer(api) as server:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(server.kubeconfig())
        disc = KubernetesDiscovery("ns", None, kubeconfig=str(kubeconfig), service="workers")
        stop = threading.Event()
        thread = threading.Thread(target=disc.slices.run, args=(lambda: None, stop))
        thread.start()
        deadline = time.monotonic() + WAIT_S
        # The server holds the watch open for watch_timeout_s (300 s) with nothing to send.
        while disc.slices._resp is None:
            assert time.monotonic() < deadline, "no watch opened"
            time.sleep(0.01)
        stop.set()
        disc.slices.cut()
        thread.join(WAIT_S)
        assert not thread.is_alive(), "a cut watch kept its thread blocked"

        # The window cut() cannot see: no response yet. Opening with `stop` already set shuts
        # the new response, so its first read ends instead of waiting on the server.
        opened = disc.slices._open_watch(stop)
        started = time.monotonic()
        resp = opened("ns", watch=True, timeout_seconds=300, _preload_content=False)
        with contextlib.suppress(Exception):  # a shut socket reads as EOF or as an error
            resp.read()
        assert time.monotonic() - started < WAIT_S
