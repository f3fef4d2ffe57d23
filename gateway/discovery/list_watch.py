"""List, then watch, one Kubernetes collection from a thread, for worker discovery.

The official client is synchronous, so each list/watch loop (`ListWatch`) runs in a daemon
thread and `run_watches` hands each new worker set to the gateway's event loop; the loop itself
never blocks on the API server. Used by EndpointSlice discovery (k8s.py) and InferencePool
discovery (inferencepool.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

T = TypeVar("T")  # what a discovery finds: workers (WorkerEndpoint) or peer gateways (str)

_GONE = 410


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
    workers: Callable[[], frozenset[T]],
    on_change: Callable[[frozenset[T]], Awaitable[None]],
    what: str,
) -> None:
    """Run each watch in its own thread; call `on_change` with `workers()` whenever it changes
    (at least once), until cancelled. `workers()` runs under the watches' lock."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[frozenset[T]] = asyncio.Queue()
    stop = threading.Event()
    # A new subscriber gets the current set first.
    emitted: list[frozenset[T] | None] = [None]

    def changed() -> None:
        with watches[0].lock:
            current = workers()
            if current == emitted[0]:
                return
            emitted[0] = current
        log.info("%s: %d found", what, len(current))
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


def _object_id(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}"
