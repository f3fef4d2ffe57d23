"""InferencePoolDiscovery through the real `kubernetes` client against a local API server that
serves InferencePool v1 objects (a CRD) and pods."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from gateway.config import GatewayConfig
from gateway.discovery.inferencepool import InferencePoolDiscovery, pool_urls, pool_workers
from tests.support.discovery import WAIT_S, Recorder
from tests.support.k8s_fake_api import FakeApi, FakeApiServer, make_pod, make_pool
from tests.support.waits import until

W = {"app": "w"}


def test_pool_urls_ready_pods_on_every_target_port() -> None:
    pool = make_pool("p", W, [8000, 8001])
    pods = [
        make_pod("a", "10.0.0.1", True, W),
        make_pod("b", "10.0.0.2", False, W),  # not ready
        make_pod("c", None, True, W),  # no IP yet
        make_pod("d", "10.0.0.4", True, W, terminating=True),
        make_pod("e", "10.0.0.5", True, {"app": "other"}),
        make_pod("f", "10.0.0.6", True, {**W, "extra": "label"}),  # a superset still matches
        make_pod("g", "fd00::7", True, W),
    ]
    assert pool_urls([pool], pods) == {
        f"http://{h}:{p}" for h in ("10.0.0.1", "10.0.0.6", "[fd00::7]") for p in (8000, 8001)
    }
    # matchLabels is required by the CRD; an empty one must not select every pod.
    assert pool_urls([make_pool("p", {}, [8000])], pods) == frozenset()
    assert pool_urls([], pods) == frozenset()
    # Each worker names its pod, for a vLLM worker's events topic (--vllm-kv-events-topic {pod}).
    pods_of = {w.url: w.pod for w in pool_workers([pool], pods)}
    assert pods_of["http://10.0.0.6:8001"] == "f" and pods_of["http://[fd00::7]:8000"] == "g"


def test_config_needs_pool_and_namespace() -> None:
    with pytest.raises(ValueError, match="--inference-pool"):
        GatewayConfig(discovery="inferencepool", k8s_namespace="ns")
    with pytest.raises(ValueError, match="--k8s-namespace"):
        GatewayConfig(discovery="inferencepool", inference_pool="p")
    GatewayConfig(discovery="inferencepool", k8s_namespace="ns", inference_pool="p")


def url(ip: str, port: int = 8000) -> str:
    return f"http://{ip}:{port}"


def test_discovery_follows_the_pool_and_its_pods(tmp_path: Path) -> None:
    api = FakeApi()
    api.put(make_pool("pool", W, [8000, 8001]))
    api.put(make_pool("another", {"app": "x"}, [9000]))  # same namespace, another pool
    api.put(make_pod("a", "10.0.0.1", True, W))
    api.put(make_pod("b", "10.0.0.2", False, W))
    api.put(make_pod("x", "10.0.9.9", True, {"app": "x"}))
    with FakeApiServer(api) as server:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(server.kubeconfig())
        disc = InferencePoolDiscovery(
            "ns", "pool", str(kubeconfig), backoff_initial_s=0.05, backoff_max_s=0.2
        )
        asyncio.run(_scenario(api, disc))
        deadline = time.monotonic() + WAIT_S
        while any(t.name.startswith("kvgate-k8s-") for t in threading.enumerate()):
            assert time.monotonic() < deadline, "discovery threads still running"
            time.sleep(0.05)


async def _scenario(api: FakeApi, disc: InferencePoolDiscovery) -> None:
    rec = Recorder()
    task = asyncio.create_task(disc.run(rec))
    try:
        await rec.until({url("10.0.0.1"), url("10.0.0.1", 8001)})
        # Only the named pool is read (a field selector on its name), all pods of its namespace.
        assert api.lists("InferencePool")[0].field_selector == "metadata.name=pool"
        await until(lambda: len(api.watches("Pod")) == 1, "the pod watch", WAIT_S)
        await until(lambda: len(api.watches("InferencePool")) == 1, "the pool watch", WAIT_S)

        # A pod turns ready; another pod of the pool appears.
        api.put(make_pod("b", "10.0.0.2", True, W))
        api.put(make_pod("c", "10.0.0.3", True, W))
        both = {"10.0.0.1", "10.0.0.2", "10.0.0.3"}
        await rec.until({url(ip, p) for ip in both for p in (8000, 8001)})

        # The pool's target ports change.
        api.put(make_pool("pool", W, [8001]))
        await rec.until({url(ip, 8001) for ip in both})

        # The pool's selector changes: pods are matched again, no new pod watch needed.
        pod_watches = len(api.watches("Pod"))
        api.put(make_pool("pool", {"app": "x"}, [8001]))
        await rec.until({url("10.0.9.9", 8001)})
        assert len(api.watches("Pod")) == pod_watches
        api.put(make_pool("pool", W, [8000]))
        await rec.until({url(ip) for ip in both})

        # A pod goes: deleted, or terminating.
        api.delete("c", kind="Pod")
        api.put(make_pod("b", "10.0.0.2", True, W, terminating=True))
        await rec.until({url("10.0.0.1")})

        # 410 Gone on both watches: a change made meanwhile is seen by relisting.
        lists = len(api.lists("Pod"))
        api.put(make_pod("d", "10.0.0.4", True, W), quietly=True)
        api.expire()
        await rec.until({url("10.0.0.1"), url("10.0.0.4")})
        assert len(api.lists("Pod")) > lists

        # The pool is deleted: no workers.
        api.delete("pool", kind="InferencePool")
        await rec.until(set())
        assert all(a != b for a, b in zip(rec.sets, rec.sets[1:], strict=False))
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
