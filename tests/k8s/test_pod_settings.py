"""The pod-level settings platform teams need, on every workload (gateway, EPP, kvgate and vLLM
workers): each renders where Kubernetes reads it, the whole render passes strict validation
against the Kubernetes 1.33 schemas (and the newest), and the chart's schema refuses malformed
values instead of letting them reach the cluster."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from tests.k8s.test_chart import chart, container, load_values, one, render  # noqa: F401

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")

VERSIONS = ("1.33.0", kubernetes_validate.latest_version())
DIGEST = "sha256:" + "ab" * 32
INIT = {"name": "warm-cache", "image": "busybox:1.36", "command": ["sh", "-c", "true"]}
VOLUME = {"name": "nvme", "hostPath": {"path": "/mnt/nvme", "type": "Directory"}}
MOUNT = {"name": "nvme", "mountPath": "/mnt/nvme", "readOnly": True}
SPREAD = {
    "maxSkew": 1,
    "topologyKey": "topology.kubernetes.io/zone",
    "whenUnsatisfiable": "DoNotSchedule",
    "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "kvgate"}},
}
POD = {
    "runtimeClassName": "nvidia",
    "priorityClassName": "inference-critical",
    "initContainers": [INIT],
    "extraVolumes": [VOLUME],
    "extraVolumeMounts": [MOUNT],
    "topologySpreadConstraints": [SPREAD],
}
# (component, kind) -> the values that set it up.
WORKLOADS = {
    ("gateway", "Deployment"): {
        "gateway": {**POD, "image": {"repository": "r/gw", "digest": DIGEST}},
    },
    ("epp", "Deployment"): {
        "epp": {"enabled": True, **POD},
        "gateway": {"image": {"repository": "r/gw", "digest": DIGEST}},
    },
    ("worker", "StatefulSet"): {
        "worker": {**POD, "image": {"repository": "r/worker", "digest": DIGEST}},
    },
}


def validate(docs: list[dict[str, Any]]) -> None:
    """Strictly, every object Kubernetes itself defines (the CRDs' objects: their own tests)."""
    for doc in docs:
        if "." in doc["apiVersion"].split("/")[0] and ".k8s.io/" not in doc["apiVersion"]:
            continue  # monitoring.coreos.com, inference.networking.x-k8s.io, ...
        if doc["apiVersion"].startswith(("inference.", "gateway.")):
            continue
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def check_pod(obj: dict[str, Any], image: str) -> None:
    pod = obj["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["priorityClassName"] == "inference-critical"
    assert pod["initContainers"] == [INIT]
    assert VOLUME in pod["volumes"] and MOUNT in container(obj)["volumeMounts"]
    assert pod["topologySpreadConstraints"] == [SPREAD]  # yours replace the default spread
    assert container(obj)["image"] == image


@pytest.mark.parametrize(("component", "kind"), list(WORKLOADS))
def test_every_workload_takes_the_pod_settings(chart, component: str, kind: str) -> None:  # noqa: F811
    values = {"model": {"demo": True}, **WORKLOADS[(component, kind)]}
    docs = render(chart, values)
    validate(docs)
    repo = "r/worker" if component == "worker" else "r/gw"
    check_pod(one(docs, kind, component), f"{repo}@{DIGEST}")


def test_vllm_workers_take_them_too(chart) -> None:  # noqa: F811
    values = load_values("values-vllm.yaml")
    image = {"repository": "vllm/vllm-openai", "tag": "v0.33.0", "digest": DIGEST}
    values["worker"] = {**values.get("worker", {}), **POD}
    values["worker"]["vllm"] = {**values["worker"].get("vllm", {}), "image": image}
    docs = render(chart, values)
    validate(docs)
    check_pod(one(docs, "StatefulSet", "worker"), f"vllm/vllm-openai@{DIGEST}")


def test_gateway_pods_spread_across_nodes_by_default(chart) -> None:  # noqa: F811
    docs = render(chart, {"model": {"demo": True}, "epp": {"enabled": True}})
    validate(docs)
    for component in ("gateway", "epp"):
        pod = one(docs, "Deployment", component)["spec"]["template"]["spec"]
        (spread,) = pod["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname"
        assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # a one-node cluster still runs
        labels = spread["labelSelector"]["matchLabels"]
        assert labels["app.kubernetes.io/component"] == component
        assert "runtimeClassName" not in pod and "initContainers" not in pod
    off = render(chart, {"model": {"demo": True}, "gateway": {"spreadAcrossNodes": False}})
    pod = one(off, "Deployment", "gateway")["spec"]["template"]["spec"]
    assert "topologySpreadConstraints" not in pod


@pytest.mark.parametrize(
    "bad",
    [
        {"gateway": {"runtimeClassName": "Not A Name"}},
        {"worker": {"priorityClassName": 7}},
        {"worker": {"initContainers": [{"name": "no-image"}]}},
        {"epp": {"extraVolumes": [{"hostPath": {"path": "/x"}}]}},
        {"gateway": {"extraVolumeMounts": [{"name": "v", "mountPath": "relative"}]}},
        {"worker": {"image": {"repository": "r", "digest": "latest"}}},
        {"gateway": {"topologySpreadConstraints": [{"maxSkew": 0}]}},
        {"gateway": {"runtimeClass": "nvidia"}},  # a misspelt key is still refused
        {"wroker": {"replicas": 4}},  # at the top level too
        {"metric": {"serviceMonitor": {"enabled": True}}},
    ],
)
def test_the_schema_checks_them(chart, bad: dict) -> None:  # noqa: F811
    with pytest.raises(helm.HelmValuesError):
        chart.render(
            {"model": {"demo": True}, **bad}, name="kvgate", namespace="inference", is_install=True
        )


def test_a_parent_charts_keys_are_taken(chart) -> None:  # noqa: F811
    """As a subchart: the parent's `global` values and its `condition` switch."""
    out = chart.render(
        {"model": {"demo": True}, "global": {"imageRegistry": "r"}, "enabled": True},
        name="kvgate",
        namespace="inference",
        is_install=True,
    )
    assert any(name.endswith("worker-statefulset.yaml") for name in out)
