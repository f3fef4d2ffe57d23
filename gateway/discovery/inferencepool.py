"""Worker discovery from a Gateway API InferencePool (`inference.networking.k8s.io/v1`).

The pool names its model-server pods with `spec.selector.matchLabels` and the ports to reach
them with `spec.targetPorts`; every (ready pod, target port) pair is one worker,
`http://<pod IP>:<port>`, as the endpoint picker protocol addresses endpoints (`ip:port`). Two
watches (`ListWatch`): the one InferencePool (a field selector on its name) and the pods of its
namespace, matched against the pool's selector here, as the extension's own EPP does, so a
changed selector needs no new pod watch.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from kubernetes import client

from gateway.discovery.endpoints import WorkerEndpoint
from gateway.discovery.list_watch import Backoff, ListWatch, run_watches

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
PLURAL = "inferencepools"


def pool_selector(pool: dict[str, Any]) -> tuple[dict[str, str], list[int]]:
    """(matchLabels, target port numbers) of an InferencePool (empty when malformed)."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = [p["number"] for p in spec.get("targetPorts") or () if isinstance(p.get("number"), int)]
    return {str(k): str(v) for k, v in labels.items()}, ports


def pod_ready(pod: dict[str, Any]) -> bool:
    """Has an IP, is not terminating, and its Ready condition is True."""
    status = pod.get("status") or {}
    if not status.get("podIP") or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = status.get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pool_urls(pools: Iterable[dict[str, Any]], pods: Iterable[dict[str, Any]]) -> frozenset[str]:
    """Worker base URLs: every ready pod the pool selects, on every target port."""
    return frozenset(w.url for w in pool_workers(pools, pods))


def pool_workers(
    pools: Iterable[dict[str, Any]], pods: Iterable[dict[str, Any]]
) -> frozenset[WorkerEndpoint]:
    """Every ready pod the pool selects, on every target port, with its pod name."""
    out: set[WorkerEndpoint] = set()
    for pool in pools:
        labels, ports = pool_selector(pool)
        if not labels:  # the CRD requires matchLabels; an empty one must not select everything
            continue
        for pod in pods:
            have = (pod.get("metadata") or {}).get("labels") or {}
            if not pod_ready(pod) or any(have.get(k) != v for k, v in labels.items()):
                continue
            ip = pod["status"]["podIP"]
            host = f"[{ip}]" if ":" in ip else ip
            pod_name = (pod.get("metadata") or {}).get("name")
            out.update(WorkerEndpoint(f"http://{host}:{port}", pod=pod_name) for port in ports)
    return frozenset(out)


class InferencePoolDiscovery:
    """The workers of one InferencePool in `namespace`, as its pods turn ready or go."""

    def __init__(
        self,
        namespace: str,
        pool: str,
        kubeconfig: str | None = None,
        *,
        watch_timeout_s: int = 300,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.namespace = namespace
        self.pool = pool
        lock = threading.Lock()
        common: dict[str, Any] = {
            "lock": lock,
            "kubeconfig": kubeconfig,
            "watch_timeout_s": watch_timeout_s,
        }
        self.pools = ListWatch(
            "InferencePool",
            lambda api: client.CustomObjectsApi(api).list_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            backoff=Backoff(backoff_initial_s, backoff_max_s),
            field_selector=f"metadata.name={pool}",
            **common,
        )
        self.pods = ListWatch(
            "Pod",
            lambda api: client.CoreV1Api(api).list_namespaced_pod,
            namespace,
            backoff=Backoff(backoff_initial_s, backoff_max_s),
            **common,
        )

    async def run(self, on_change: Callable[[frozenset[WorkerEndpoint]], Awaitable[None]]) -> None:
        def workers() -> frozenset[WorkerEndpoint]:
            return pool_workers(self.pools.objects.values(), self.pods.objects.values())

        what = f"InferencePool {self.namespace}/{self.pool}"
        await run_watches([self.pools, self.pods], workers, on_change, what)
