"""A tiny Kubernetes API server: list and watch, as the real one speaks them.

It serves EndpointSlices, Pods and InferencePools (`inference.networking.k8s.io/v1`, a CRD:
served like any custom resource), with label and field (`metadata.name=`) selectors. Enough of
the protocol for a client: a list carries the collection's resourceVersion; a watch from a
version streams ADDED/MODIFIED/DELETED JSON lines (chunked) after it; a version older than the
compaction point gets an ERROR event with a 410 Status; `drop()` cuts open watches mid-stream.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

# kind -> (URL prefix, collection name); resourceVersions are shared by all, as in etcd.
RESOURCES = {
    "EndpointSlice": ("/apis/discovery.k8s.io/v1/namespaces/", "endpointslices"),
    "Pod": ("/api/v1/namespaces/", "pods"),
    "InferencePool": ("/apis/inference.networking.k8s.io/v1/namespaces/", "inferencepools"),
}


def make_slice(
    name: str,
    endpoints: list[tuple[str, bool | None]],
    *,
    service: str = "workers",
    http_port: int = 8000,
    labels: dict[str, str] | None = None,
    pods: list[str] | None = None,
) -> dict[str, Any]:
    """An EndpointSlice with one endpoint per (ip, ready) pair; ready None leaves it unset;
    `pods`: the pod behind each endpoint (its targetRef), as Kubernetes fills it in."""
    eps = []
    for i, (ip, ready) in enumerate(endpoints):
        conditions = {} if ready is None else {"ready": ready}
        eps.append({"addresses": [ip], "conditions": conditions})
        if pods is not None:
            eps[-1]["targetRef"] = {"kind": "Pod", "name": pods[i], "namespace": "ns"}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "labels": {"kubernetes.io/service-name": service, **(labels or {})},
        },
        "addressType": "IPv4",
        "endpoints": eps,
        "ports": [
            {"name": "http", "port": http_port, "protocol": "TCP"},
            {"name": "kv-events", "port": 5557, "protocol": "TCP"},
        ],
    }


def make_pod(
    name: str, ip: str | None, ready: bool, labels: dict[str, str], *, terminating: bool = False
) -> dict[str, Any]:
    """A Pod as the API shows it: labels, its IP once it has one, the Ready condition."""
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": labels}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}


def make_pool(name: str, labels: dict[str, str], ports: list[int]) -> dict[str, Any]:
    """An InferencePool v1 (the fields the CRD requires, and an endpoint picker reference)."""
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}},
        },
    }


@dataclass
class Request:
    watch: bool
    resource_version: str | None
    label_selector: str | None
    kind: str = "EndpointSlice"
    field_selector: str | None = None


@dataclass
class FakeApi:
    rv: int = 100
    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    compacted: int = 0  # watches from a version below this get 410
    generation: int = 0  # bumped to make open watches end (drop or expire)
    expire_open: bool = False
    requests: list[Request] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    # ---- what the test does -------------------------------------------------------------------

    def put(self, sl: dict[str, Any], *, quietly: bool = False) -> None:
        """Create or update an object; `quietly` leaves no watch event (only a relist sees it)."""
        with self.cond:
            self.rv += 1
            obj = json.loads(json.dumps(sl))
            obj["metadata"]["resourceVersion"] = str(self.rv)
            key = (obj["kind"], obj["metadata"]["name"])
            kind = "MODIFIED" if key in self.objects else "ADDED"
            self.objects[key] = obj
            if not quietly:
                self.history.append((self.rv, kind, obj))
            self.cond.notify_all()

    def delete(self, name: str, *, kind: str = "EndpointSlice", quietly: bool = False) -> None:
        with self.cond:
            self.rv += 1
            obj = self.objects.pop((kind, name))
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
            if not quietly:
                self.history.append((self.rv, "DELETED", obj))
            self.cond.notify_all()

    def expire(self) -> None:
        """Compact history: open watches get 410 Gone, as do resumes from any older version."""
        with self.cond:
            self.compacted = self.rv
            self.history.clear()
            self.expire_open = True
            self.generation += 1
            self.cond.notify_all()

    def drop(self) -> None:
        """Cut every open watch connection without ending the chunked stream."""
        with self.cond:
            self.expire_open = False
            self.generation += 1
            self.cond.notify_all()

    def watches(self, kind: str = "EndpointSlice") -> list[Request]:
        with self.cond:
            return [r for r in self.requests if r.watch and r.kind == kind]

    def lists(self, kind: str = "EndpointSlice") -> list[Request]:
        with self.cond:
            return [r for r in self.requests if not r.watch and r.kind == kind]

    # ---- the server side ----------------------------------------------------------------------

    def matching(self, obj: dict[str, Any], req: Request) -> bool:
        if obj["kind"] != req.kind:
            return False
        labels = obj["metadata"].get("labels") or {}
        for term in filter(None, (req.label_selector or "").split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        for term in filter(None, (req.field_selector or "").split(",")):
            key, _, value = term.partition("=")
            if key != "metadata.name":
                raise ValueError(f"field selector {key!r} is not served here")
            if obj["metadata"]["name"] != value:
                return False
        return True


def _status_410() -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": "too old resource version",
        "reason": "Expired",
        "code": 410,
    }


def make_handler(api: FakeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            url = urlparse(self.path)
            kind = next(
                (
                    k
                    for k, (prefix, plural) in RESOURCES.items()
                    if url.path.startswith(prefix) and url.path.endswith(f"/{plural}")
                ),
                None,
            )
            if kind is None:
                self._send_json(404, {"kind": "Status", "code": 404, "message": "not found"})
                return
            q = {k: v[0] for k, v in parse_qs(url.query).items()}
            is_watch = q.get("watch") in ("true", "1", "True")
            req = Request(
                is_watch,
                q.get("resourceVersion"),
                q.get("labelSelector"),
                kind,
                q.get("fieldSelector"),
            )
            with api.cond:
                api.requests.append(req)
            if is_watch:
                self._watch(req, float(q.get("timeoutSeconds", "30")))
            else:
                self._list(req)

        def _send_json(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _list(self, req: Request) -> None:
            with api.cond:
                items = [o for o in api.objects.values() if api.matching(o, req)]
                body = {
                    "kind": f"{req.kind}List",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(api.rv)},
                    "items": items,
                }
            self._send_json(200, body)

        def _chunk(self, event: dict[str, Any]) -> None:
            line = json.dumps(event).encode() + b"\n"
            self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            self.wfile.flush()

        def _watch(self, req: Request, timeout_s: float) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            sent = int(req.resource_version or 0)
            with api.cond:
                if sent < api.compacted:
                    self._chunk({"type": "ERROR", "object": _status_410()})
                    self.wfile.write(b"0\r\n\r\n")
                    return
                generation = api.generation
                while True:
                    for rv, kind, obj in api.history:
                        if rv > sent and api.matching(obj, req):
                            self._chunk({"type": kind, "object": obj})
                        sent = max(sent, rv)
                    if api.generation != generation:
                        break
                    if not api.cond.wait(timeout=timeout_s):
                        self.wfile.write(b"0\r\n\r\n")  # the server-side watch timeout
                        return
                if api.expire_open:
                    self._chunk({"type": "ERROR", "object": _status_410()})
                    self.wfile.write(b"0\r\n\r\n")
                    return
            # A drop: no terminating chunk, just a dead connection.
            self.close_connection = True
            self.connection.shutdown(2)

    return Handler


class FakeApiServer:
    def __init__(self, api: FakeApi, port: int = 0) -> None:
        self.api = api
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), make_handler(api))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.api.drop()
        self.httpd.shutdown()
        self.httpd.server_close()

    def kubeconfig(self) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}
                ],
                "users": [{"name": "fake", "user": {"token": "test-token"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
