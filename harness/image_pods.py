"""The chart's worker and gateway containers (CPU demo values), as `harness.images` runs them.

Helm's engine renders helm/kvgate with values-cpu-demo.yaml; each container keeps its image
arguments, environment, emptyDir mount points and the pod's uid/gid. What only a cluster
provides is replaced: ports become free ones on 127.0.0.1, the gateway gets --workers instead of
EndpointSlice discovery, Secret and field references get their values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kvgate"
NAMESPACE = "kvgate"
# Flags that need a Kubernetes API server (the gateway's discovery).
CLUSTER_ONLY = ("--discovery=", "--k8s-")


@dataclass(slots=True)
class Pod:
    image: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    mounts: list[str] = field(default_factory=list)  # emptyDir mount points
    uid: int = 10001
    gid: int = 10001


def render_chart() -> list[dict[str, Any]]:
    import helm_python as helm  # the test extra; only the image tests need it

    values = yaml.safe_load((CHART / "values-cpu-demo.yaml").read_text())
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name="kvgate", namespace=NAMESPACE, is_install=True)
    return [
        doc
        for template, text in out.items()
        if not template.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def _component(docs: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    (doc,) = [
        d
        for d in docs
        if d["kind"] == kind and d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    return doc["spec"]["template"]["spec"]


def _pod(spec: dict[str, Any], image: str, token: str, args: list[str]) -> Pod:
    (c,) = spec["containers"]
    empty = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "secretKeyRef" in e.get("valueFrom", {}) and e["name"] == "KVGATE_WORKER_TOKEN":
            env[e["name"]] = token
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = NAMESPACE
    sec = spec["securityContext"]
    assert c["securityContext"]["readOnlyRootFilesystem"], "the chart's root filesystem is r/o"
    mounts = [m["mountPath"] for m in c["volumeMounts"] if m["name"] in empty]
    return Pod(image, args, env, mounts, uid=sec["runAsUser"], gid=sec["runAsGroup"])


def _local(args: list[str], port_flags: dict[str, int]) -> list[str]:
    """The chart's flags with this host's ports, on 127.0.0.1, without cluster discovery."""
    out = []
    for arg in args:
        name, _, _ = arg.partition("=")
        if arg.startswith(CLUSTER_ONLY):
            continue
        if name == "--host":
            arg = "--host=127.0.0.1"
        elif name in port_flags:
            arg = f"{name}={port_flags[name]}"
        out.append(arg)
    return out


def chart_pods(
    worker_image: str, gateway_image: str, ports: dict[str, int], token: str
) -> tuple[Pod, Pod]:
    """(worker, gateway) as the chart's CPU demo runs them, on `ports` (http, events, replay
    for the worker; gateway, admin for the gateway)."""
    docs = render_chart()
    worker_spec = _component(docs, "StatefulSet", "worker")
    (wc,) = worker_spec["containers"]
    worker_ports = {
        "--port": ports["http"],
        "--kv-events-port": ports["events"],
        "--kv-events-replay-port": ports["replay"],
    }
    worker = _pod(worker_spec, worker_image, token, _local(wc["args"], worker_ports))
    gateway_spec = _component(docs, "Deployment", "gateway")
    (gc,) = gateway_spec["containers"]
    gateway_ports = {"--port": ports["gateway"], "--admin-port": ports["admin"]}
    args = [*_local(gc["args"], gateway_ports), f"--workers=http://127.0.0.1:{ports['http']}"]
    return worker, _pod(gateway_spec, gateway_image, token, args)
