"""Worker discovery through the Kubernetes API: list, then watch, EndpointSlices.

The official client is synchronous, so the list/watch loop runs in one daemon thread and hands
each new replica set to the gateway's event loop; the loop itself never blocks on the API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from gateway.endpoints import WorkerEndpoint

log = logging.getLogger(__name__)

Emit = Callable[[frozenset[WorkerEndpoint]], None]
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# Mounted into every pod that has a service-account token: the pod's own namespace.
POD_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_GONE = 410


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


@dataclass(slots=True)
class Backoff:
    """Capped exponential backoff with full jitter, so restarted gateways do not stampede."""

    initial_s: float = 0.5
    max_s: float = 30.0
    _attempt: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError("backoff needs 0 < initial_s <= max_s")

    def next_delay(self) -> float:
        ceiling = min(self.max_s, self.initial_s * (2**self._attempt))
        self._attempt += 1
        return random.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self._attempt = 0


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
        if watch_timeout_s <= 0:
            raise ValueError("watch_timeout_s must be positive")
        self.namespace = namespace or default_namespace()
        self.selector = build_selector(label_selector, service)
        self.port_name = port_name
        self.events_port_name = events_port_name
        self.replay_port_name = replay_port_name
        self.kubeconfig = kubeconfig
        self.watch_timeout_s = watch_timeout_s
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._api: client.DiscoveryV1Api | None = None
        self._slices: dict[str, dict[str, Any]] = {}
        self._resource_version: str | None = None
        self._emitted: frozenset[WorkerEndpoint] | None = None
        self._watch: watch.Watch | None = None

    async def run(self, on_change: Callable[[frozenset[WorkerEndpoint]], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[frozenset[WorkerEndpoint]] = asyncio.Queue()
        stop = threading.Event()

        def emit(urls: frozenset[WorkerEndpoint]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed under us: we are stopping
                loop.call_soon_threadsafe(updates.put_nowait, urls)

        self._emitted = None  # a new subscriber always gets the current set first
        thread = threading.Thread(
            target=self._sync_loop, args=(emit, stop), name="kvgate-k8s-discovery", daemon=True
        )
        thread.start()
        try:
            while True:
                urls = await updates.get()
                while not updates.empty():  # only the newest set matters
                    urls = updates.get_nowait()
                await on_change(urls)
        finally:
            stop.set()
            current = self._watch
            if current is not None:
                current.stop()  # shuts the socket so the thread's blocked read returns

    # ---- the blocking side, in the discovery thread -------------------------------------------

    def _connect(self) -> client.DiscoveryV1Api:
        cfg = client.Configuration()
        if self.kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
            config.load_incluster_config(client_configuration=cfg)
        else:
            config.load_kube_config(
                config_file=self.kubeconfig, client_configuration=cfg, persist_config=False
            )
        return client.DiscoveryV1Api(client.ApiClient(cfg))

    def _sync_loop(self, emit: Emit, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                if self._api is None:
                    self._api = self._connect()
                if self._resource_version is None:
                    self._relist()
                    self._backoff.reset()
                    self._publish(emit)
                if self._watch_once(emit, stop):
                    self._backoff.reset()
                    continue
            except ApiException as exc:
                if exc.status == _GONE:
                    log.info("EndpointSlice watch expired (410 Gone); relisting")
                    self._resource_version = None
                    continue
                log.warning("Kubernetes API error %s: %s", exc.status, exc.reason)
            except Exception as exc:  # dropped connections, DNS, TLS, bad kubeconfig ...
                if stop.is_set():
                    return
                log.warning("Kubernetes API unreachable (%s: %s)", type(exc).__name__, exc)
            # Also after a watch that ended with no events, so a server that closes at once
            # cannot make us spin.
            stop.wait(self._backoff.next_delay())

    def _relist(self) -> None:
        assert self._api is not None
        resp = self._api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=self.selector,
            _preload_content=False,
            _request_timeout=30,
        )
        body = json.loads(resp.data)
        self._slices = {_slice_id(sl): sl for sl in body.get("items") or ()}
        self._resource_version = str(body["metadata"]["resourceVersion"])

    def _watch_once(self, emit: Emit, stop: threading.Event) -> bool:
        """One watch request from the last version seen; True when it delivered any event."""
        assert self._api is not None
        # return_type=object keeps raw dicts: no model conversion, tolerant of new fields.
        self._watch = w = watch.Watch(return_type=object)
        saw_events = False
        try:
            # timeout_seconds makes the client hand 410 to us instead of retrying on its own.
            for event in w.stream(
                self._api.list_namespaced_endpoint_slice,
                self.namespace,
                label_selector=self.selector,
                resource_version=self._resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.watch_timeout_s,
                _request_timeout=(10, self.watch_timeout_s + 30),
            ):
                saw_events = True
                obj = event["raw_object"]
                kind = event["type"]
                if kind in ("ADDED", "MODIFIED"):
                    self._slices[_slice_id(obj)] = obj
                elif kind == "DELETED":
                    self._slices.pop(_slice_id(obj), None)
                rv = obj.get("metadata", {}).get("resourceVersion")
                if rv:
                    self._resource_version = str(rv)
                if kind != "BOOKMARK":
                    self._publish(emit)
                if stop.is_set():
                    break
        finally:
            self._watch = None
        return saw_events

    def _publish(self, emit: Emit) -> None:
        urls = worker_endpoints(
            self._slices.values(), self.port_name, self.events_port_name, self.replay_port_name
        )
        if urls != self._emitted:
            log.info("Kubernetes discovery: %d ready worker(s)", len(urls))
            self._emitted = urls
            emit(urls)


def _slice_id(sl: dict[str, Any]) -> str:
    meta = sl["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}"
