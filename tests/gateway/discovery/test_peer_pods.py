"""Peer gateways found on Kubernetes (gateway/discovery/peer_pods.py): through the real
`kubernetes` client against a local API server, then two real gateway processes that find each
other through it and talk over CURVE-secured ZMQ (--peers-from-kubernetes)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.discovery.peer_pods import PeerPodDiscovery, peer_addresses
from harness.ports import free_port
from harness.proc import Proc
from tests.support.discovery import Recorder
from tests.support.k8s_fake_api import FakeApi, FakeApiServer, make_pod

GW = {"kvgate.io/peers": "demo"}
SELECTOR = "kvgate.io/peers=demo"


def test_peer_addresses_every_pod_with_an_ip_until_it_ends() -> None:
    ended = make_pod("e", "10.0.0.5", False, GW)
    ended["status"]["phase"] = "Succeeded"
    pods = [
        make_pod("a", "10.0.0.1", True, GW),
        make_pod("b", "10.0.0.2", False, GW),  # starting: its load counts already
        make_pod("c", None, True, GW),  # no IP yet
        make_pod("d", "10.0.0.4", True, GW, terminating=True),  # draining: still holds load
        ended,
        make_pod("v6", "fd00::7", True, GW),
    ]
    assert peer_addresses(pods, 9100) == {
        "10.0.0.1:9100",
        "10.0.0.2:9100",
        "10.0.0.4:9100",
        "[fd00::7]:9100",
    }


def test_config_needs_the_peer_port_and_a_selector() -> None:
    with pytest.raises(ValueError, match="--peer-port"):
        GatewayConfig(peers_from_kubernetes=SELECTOR)
    with pytest.raises(ValueError, match="label selector"):
        GatewayConfig(peer_port=9100, peers_from_kubernetes=" ")
    with pytest.raises(ValueError, match="label selector"):
        PeerPodDiscovery("ns", "", 9100)
    GatewayConfig(peer_port=9100, peers_from_kubernetes=SELECTOR)


def test_discovery_follows_the_gateway_pods(tmp_path: Path) -> None:
    api = FakeApi()
    api.put(make_pod("gw-a", "10.0.0.1", True, GW))
    api.put(make_pod("gw-b", None, False, GW))  # scheduled, no IP yet
    api.put(make_pod("worker", "10.0.9.9", True, {"app": "worker"}))  # not a peer

    async def scenario(disc: PeerPodDiscovery) -> None:
        rec = Recorder()
        task = asyncio.create_task(disc.run(rec))
        try:
            await rec.until({"10.0.0.1:9100"})
            assert api.lists("Pod")[0].label_selector == SELECTOR
            api.put(make_pod("gw-b", "10.0.0.2", False, GW))  # the IP arrives
            await rec.until({"10.0.0.1:9100", "10.0.0.2:9100"})
            api.delete("gw-a", kind="Pod")
            await rec.until({"10.0.0.2:9100"})
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    with FakeApiServer(api) as server:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(server.kubeconfig())
        disc = PeerPodDiscovery(
            "ns", SELECTOR, 9100, str(kubeconfig), backoff_initial_s=0.05, backoff_max_s=0.2
        )
        asyncio.run(scenario(disc))


def _peers_up(url: str) -> float | None:
    try:
        text = httpx.get(f"{url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    m = re.search(r"^kvgate_peers_up (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _wait_for(urls: list[str], up: float, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_peers_up(u) == up for u in urls):
            return
        time.sleep(0.1)
    got = [_peers_up(u) for u in urls]
    raise AssertionError(f"kvgate_peers_up != {up} within {timeout}s: {got}")


def test_gateways_find_each_other_through_the_api(tmp_path: Path) -> None:
    """Two gateway processes, as two pods would: the same --peer-port on two addresses
    (127.0.0.1 and 127.0.0.2), each finding the other, and itself, in the pod list."""
    api = FakeApi()
    hosts = ["127.0.0.1", "127.0.0.2"]
    for i, host in enumerate(hosts):
        api.put(make_pod(f"gw-{i}", host, True, GW))
    peer_port = free_port()
    with FakeApiServer(api) as server:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(server.kubeconfig())
        env = {"KUBECONFIG": str(kubeconfig), "KVGATE_WORKER_TOKEN": "peer-pods-token-0123456"}
        gateways, urls = [], []
        for i, host in enumerate(hosts):
            port = free_port()
            args = ["-m", "gateway", "--host", host, "--port", str(port)]
            args += ["--peer-port", str(peer_port), "--peers-from-kubernetes", SELECTOR]
            args += ["--k8s-namespace", "ns", "--peer-timeout", "1.0"]
            gateways.append(Proc(f"gateway-{i}", args, port, tmp_path / f"gw-{i}.log", env=env))
            urls.append(f"http://{host}:{port}")
        try:
            for g in gateways:
                g.start()
            _wait_for(urls, 1.0, 30)  # each hears the other (its own batches are ignored)
            api.delete("gw-1", kind="Pod")  # gateway 1 leaves the list: 0 stops hearing it
            _wait_for(urls[:1], 0.0, 5)
            api.put(make_pod("gw-1", hosts[1], True, GW))  # and comes back
            _wait_for(urls[:1], 1.0, 5)
            assert all(g.alive() for g in gateways), [g.log_tail() for g in gateways]
        finally:
            for g in gateways:
                g.kill()
