"""Worker discovery through the Kubernetes API: list, then watch, EndpointSlices (through
`ListWatch`, list_watch.py)."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from kubernetes import client

from gateway.discovery.endpoints import WorkerEndpoint
from gateway.discovery.list_watch import Backoff, ListWatch, run_watches

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# Mounted into every pod that has a service-account token: the pod's own namespace.
POD_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def endpoint_urls(slices: Iterable[dict[str, Any]], port_name: str) -> frozenset[str]:
    """Base URLs of every ready endpoint in `slices` (raw EndpointSlice dicts)."""
    return frozenset(w.url for w in worker_endpoints(slices, port_name))


def worker_endpoints(
    slices: Iterable[dict[str, Any]],
    port_name: str,
    events_port_name: str = "kv-events",
    replay_port_name: str = "kv-replay",
) -> frozenset[WorkerEndpoint]:
    """Every ready endpoint in `slices` (raw EndpointSlice dicts): its base URL, the slice's
    KV-events ports when it names them, and the pod behind it.

    An endpoint counts when `conditions.ready` is true or unset (the API's own reading of unset).
    """
    out: set[WorkerEndpoint] = set()
    for sl in slices:
        ports = {p.get("name") or "": p.get("port") for p in sl.get("ports") or ()}
        port = ports.get(port_name)
        if port is None or sl.get("addressType") not in ("IPv4", "IPv6"):
            continue
        events, replay = ports.get(events_port_name), ports.get(replay_port_name)
        for ep in sl.get("endpoints") or ():
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            ref = ep.get("targetRef") or {}
            pod = ref.get("name") if ref.get("kind") == "Pod" else None
            for addr in ep.get("addresses") or ():
                host = f"[{addr}]" if ":" in addr else addr
                out.add(
                    WorkerEndpoint(
                        f"http://{host}:{port}",
                        events,
                        replay,
                        pod=pod,
                    )
                )
    return frozenset(out)


def default_namespace() -> str:
    """The pod's own namespace inside a cluster, else "default"."""
    try:
        with open(POD_NAMESPACE_FILE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def build_selector(label_selector: str | None, service: str | None) -> str:
    """One label selector from a free-form selector and/or a Service name."""
    parts = [s for s in (label_selector, service and f"{SERVICE_NAME_LABEL}={service}") if s]
    if not parts:
        raise ValueError("Kubernetes discovery needs a label selector or a service name")
    return ",".join(parts)


class KubernetesDiscovery:
    """Ready worker endpoints from the EndpointSlices that match a label selector.

    Uses in-cluster credentials inside a pod, else `kubeconfig` (or the default kubeconfig).
    An empty namespace means the gateway pod's own.
    """

    def __init__(
        self,
        namespace: str | None,
        label_selector: str | None,
        port_name: str = "http",
        kubeconfig: str | None = None,
        *,
        service: str | None = None,
        events_port_name: str = "kv-events",
        replay_port_name: str = "kv-replay",
        watch_timeout_s: int = 300,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.namespace = namespace or default_namespace()
        self.selector = build_selector(label_selector, service)
        self.port_name = port_name
        self.events_port_name = events_port_name
        self.replay_port_name = replay_port_name
        self.slices = ListWatch(
            "EndpointSlice",
            lambda api: client.DiscoveryV1Api(api).list_namespaced_endpoint_slice,
            self.namespace,
            lock=threading.Lock(),
            kubeconfig=kubeconfig,
            watch_timeout_s=watch_timeout_s,
            backoff=Backoff(backoff_initial_s, backoff_max_s),
            label_selector=self.selector,
        )

    async def run(self, on_change: Callable[[frozenset[WorkerEndpoint]], Awaitable[None]]) -> None:
        def workers() -> frozenset[WorkerEndpoint]:
            return worker_endpoints(
                self.slices.objects.values(),
                self.port_name,
                self.events_port_name,
                self.replay_port_name,
            )

        await run_watches([self.slices], workers, on_change, "Kubernetes discovery")
