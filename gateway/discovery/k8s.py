"""Worker discovery through the Kubernetes API: list, then watch, EndpointSlices.

The official client is synchronous, so each list/watch loop (`ListWatch`) runs in a daemon
thread and `run_watches` hands each new replica set to the gateway's event loop; the loop itself
never blocks on the API server. gateway/discovery/inferencepool.py watches its two collections
(InferencePools and pods) the same way.
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

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# Mounted into every pod that has a service-account token: the pod's own namespace.
POD_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_GONE = 410


def endpoint_urls(slices: Iterable[dict[str, Any]], port_name: str) -> frozenset[str]:
    """Base URLs of every ready endpoint in `slices` (raw EndpointSlice dicts).

    An endpoint counts when `conditions.ready` is true or unset (the API's own reading of unset).
    """
    urls: set[str] = set()
    for sl in slices:
        port = next(
            (p.get("port") for p in sl.get("ports") or () if (p.get("name") or "") == port_name),
            None,
        )
        if port is None or sl.get("addressType") not in ("IPv4", "IPv6"):
            continue
        for ep in sl.get("endpoints") or ():
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            for addr in ep.get("addresses") or ():
                host = f"[{addr}]" if ":" in addr else addr
                urls.add(f"http://{host}:{port}")
    return frozenset(urls)


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


def api_client(kubeconfig: str | None) -> client.ApiClient:
    """In-cluster credentials inside a pod, else `kubeconfig` (or the default kubeconfig)."""
    cfg = client.Configuration()
    if kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(
            config_file=kubeconfig, client_configuration=cfg, persist_config=False
        )
    return client.ApiClient(cfg)


class ListWatch:
    """One collection, listed then watched from the last version seen, kept as raw dicts.

    `make_list(api_client)` gives the client's list function (called with `args` and `query`,
    e.g. a label or field selector). A watch resumes from the last `resourceVersion`; a `410
    Gone` relists; API errors and dropped connections back off (capped, jittered) while the
    objects last seen stay in use. `changed()` runs after every change, with `lock` held by
    nobody; `objects` is only mutated under `lock`.
    """

    def __init__(
        self,
        kind: str,
        make_list: Callable[[client.ApiClient], Callable[..., Any]],
        *args: Any,
        lock: threading.Lock,
        kubeconfig: str | None = None,
        watch_timeout_s: int = 300,
        backoff: Backoff | None = None,
        **query: Any,
    ) -> None:
        if watch_timeout_s <= 0:
            raise ValueError("watch_timeout_s must be positive")
        self.kind = kind
        self.make_list = make_list
        self.args = args
        self.query = query
        self.lock = lock
        self.kubeconfig = kubeconfig
        self.watch_timeout_s = watch_timeout_s
        self.backoff = backoff or Backoff()
        self.objects: dict[str, dict[str, Any]] = {}
        self._list: Callable[..., Any] | None = None
        self._resource_version: str | None = None
        # The open watch's response, so `cut()` can shut its socket from another thread.
        self._resp: Any = None
        self._resp_lock = threading.Lock()

    def run(self, changed: Callable[[], None], stop: threading.Event) -> None:
        """The blocking loop, in its own thread, until `stop` is set."""
        while not stop.is_set():
            try:
                if self._list is None:
                    self._list = self.make_list(api_client(self.kubeconfig))
                if self._resource_version is None:
                    self._relist()
                    self.backoff.reset()
                    changed()
                if self._watch_once(changed, stop):
                    self.backoff.reset()
                    continue
            except ApiException as exc:
                if exc.status == _GONE:
                    log.info("%s watch expired (410 Gone); relisting", self.kind)
                    self._resource_version = None
                    continue
                log.warning("Kubernetes API error %s: %s", exc.status, exc.reason)
            except Exception as exc:  # dropped connections, DNS, TLS, bad kubeconfig ...
                if stop.is_set():
                    return
                log.warning("Kubernetes API unreachable (%s: %s)", type(exc).__name__, exc)
            # Also after a watch that ended with no events, so a server that closes at once
            # cannot make us spin.
            stop.wait(self.backoff.next_delay())

    def cut(self) -> None:
        """Shut the open watch's socket, so the thread's blocked read returns. Call after
        setting the `stop` given to `run()`: a watch opening meanwhile then shuts itself."""
        with self._resp_lock:
            resp = self._resp
        if resp is not None:
            resp.shutdown()

    def _open_watch(self, stop: threading.Event) -> Callable[..., Any]:
        """The list function, remembering each response it opens for `cut()`."""
        assert self._list is not None
        list_fn = self._list

        def opened(*args: Any, **kwargs: Any) -> Any:
            resp = list_fn(*args, **kwargs)
            with self._resp_lock:
                self._resp = resp
            if stop.is_set():  # cut() ran before the response existed
                resp.shutdown()
            return resp

        return opened

    def _relist(self) -> None:
        assert self._list is not None
        resp = self._list(*self.args, **self.query, _preload_content=False, _request_timeout=30)
        body = json.loads(resp.data)
        with self.lock:
            self.objects = {_object_id(o): o for o in body.get("items") or ()}
        self._resource_version = str(body["metadata"]["resourceVersion"])

    def _watch_once(self, changed: Callable[[], None], stop: threading.Event) -> bool:
        """One watch request from the last version seen; True when it delivered any event."""
        # return_type=object keeps raw dicts: no model conversion, tolerant of new fields.
        w = watch.Watch(return_type=object)
        saw_events = False
        try:
            # timeout_seconds makes the client hand 410 to us instead of retrying on its own.
            for event in w.stream(
                self._open_watch(stop),
                *self.args,
                **self.query,
                resource_version=self._resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.watch_timeout_s,
                _request_timeout=(10, self.watch_timeout_s + 30),
            ):
                saw_events = True
                obj = event["raw_object"]
                kind = event["type"]
                with self.lock:
                    if kind in ("ADDED", "MODIFIED"):
                        self.objects[_object_id(obj)] = obj
                    elif kind == "DELETED":
                        self.objects.pop(_object_id(obj), None)
                rv = obj.get("metadata", {}).get("resourceVersion")
                if rv:
                    self._resource_version = str(rv)
                if kind != "BOOKMARK":
                    changed()
                if stop.is_set():
                    break
        finally:
            with self._resp_lock:
                self._resp = None
        return saw_events


async def run_watches(
    watches: list[ListWatch],
    urls: Callable[[], frozenset[str]],
    on_change: Callable[[frozenset[str]], Awaitable[None]],
    what: str,
) -> None:
    """Run each watch in its own thread; call `on_change` with `urls()` whenever it changes
    (at least once), until cancelled. `urls()` runs under the watches' lock."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[frozenset[str]] = asyncio.Queue()
    stop = threading.Event()
    emitted: list[frozenset[str] | None] = [None]  # a new subscriber gets the current set first

    def changed() -> None:
        with watches[0].lock:
            current = urls()
            if current == emitted[0]:
                return
            emitted[0] = current
        log.info("%s: %d ready worker(s)", what, len(current))
        with contextlib.suppress(RuntimeError):  # the loop closed under us: we are stopping
            loop.call_soon_threadsafe(updates.put_nowait, current)

    for w in watches:
        name = f"kvgate-k8s-{w.kind.lower()}"
        threading.Thread(target=w.run, args=(changed, stop), name=name, daemon=True).start()
    try:
        while True:
            current = await updates.get()
            while not updates.empty():  # only the newest set matters
                current = updates.get_nowait()
            await on_change(current)
    finally:
        stop.set()
        for w in watches:
            w.cut()


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
        watch_timeout_s: int = 300,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.namespace = namespace or default_namespace()
        self.selector = build_selector(label_selector, service)
        self.port_name = port_name
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

    async def run(self, on_change: Callable[[frozenset[str]], Awaitable[None]]) -> None:
        def urls() -> frozenset[str]:
            return endpoint_urls(self.slices.objects.values(), self.port_name)

        await run_watches([self.slices], urls, on_change, "Kubernetes discovery")


def _object_id(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}"
