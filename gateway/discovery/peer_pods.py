"""Peer discovery on Kubernetes: the gateway's own pods, found as the workers are (list_watch.py).

Every pod that matches `--peers-from-kubernetes` (a label selector the chart sets on its gateway
and endpoint-picker pods alike) and has an IP is a peer at `<pod IP>:<--peer-port>`; this
gateway's own pod is among them, and its own batches are ignored (gateway/peers/link.py).

Readiness is not asked: a gateway that is still starting, or draining with requests in flight
(terminating), holds load on the workers its peers must count. A pod that has ended (Succeeded,
Failed) or has no IP yet is none. A peer that goes silent is dropped by `--peer-timeout` whatever
discovery says, so a stale list costs a reconnect attempt, never a blocked request.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from kubernetes import client

from gateway.discovery.list_watch import Backoff, ListWatch, run_watches

ENDED = ("Succeeded", "Failed")


def peer_addresses(pods: Iterable[dict[str, Any]], port: int) -> frozenset[str]:
    """`HOST:PORT` of every pod that has an IP and has not ended."""
    out: set[str] = set()
    for pod in pods:
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if not ip or status.get("phase") in ENDED:
            continue
        out.add(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return frozenset(out)


class PeerPodDiscovery:
    """The peer gateways: pods in `namespace` matching `label_selector`, each at `port`."""

    def __init__(
        self,
        namespace: str,
        label_selector: str,
        port: int,
        kubeconfig: str | None = None,
        *,
        watch_timeout_s: int = 300,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        if not label_selector:
            raise ValueError("peer discovery needs a label selector")
        self.namespace, self.selector, self.port = namespace, label_selector, port
        self.pods = ListWatch(
            "Pod",
            lambda api: client.CoreV1Api(api).list_namespaced_pod,
            namespace,
            lock=threading.Lock(),
            kubeconfig=kubeconfig,
            watch_timeout_s=watch_timeout_s,
            backoff=Backoff(backoff_initial_s, backoff_max_s),
            label_selector=label_selector,
        )

    async def run(self, on_change: Callable[[frozenset[str]], Awaitable[None]]) -> None:
        def peers() -> frozenset[str]:
            return peer_addresses(self.pods.objects.values(), self.port)

        what = f"peer gateways ({self.selector})"
        await run_watches([self.pods], peers, on_change, what)
