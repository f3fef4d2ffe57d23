"""The Helm chart and manifests/: rendered by Helm's engine, checked against Kubernetes schemas."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kvgate"
MANIFESTS = ROOT / "manifests"
K8S_VERSION = kubernetes_validate.latest_version()

# ServiceMonitor is a Prometheus Operator CRD, absent from the Kubernetes schemas: the fields we
# emit are checked against this subset of the CRD's schema instead.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "properties": {"matchLabels": {"type": "object"}},
                    "additionalProperties": False,
                },
                "namespaceSelector": {
                    "type": "object",
                    "properties": {"matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "relabelings": {"type": "array", "items": {"type": "object"}},
                            "authorization": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["credentials"],
                                "properties": {
                                    "type": {"type": "string"},
                                    "credentials": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "required": ["name", "key"],
                                        "properties": {
                                            "name": {"type": "string"},
                                            "key": {"type": "string"},
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(CHART) as c:
        yield c


def load_values(name: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / name).read_text())


def render(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out = chart.render(values, name="kvgate", namespace="inference", is_install=True)
    docs = []
    for template, text in out.items():
        if template.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def validate_all(docs: list[dict[str, Any]]) -> None:
    assert docs
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def one(docs: list[dict[str, Any]], kind: str, component: str | None = None) -> dict[str, Any]:
    found = [
        d
        for d in docs
        if d["kind"] == kind
        and (
            component is None or d["metadata"]["labels"]["app.kubernetes.io/component"] == component
        )
    ]
    assert len(found) == 1, f"{kind}/{component}: {len(found)} objects"
    return found[0]


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def test_default_values(chart: Any) -> None:
    docs = render(chart)
    validate_all(docs)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "ConfigMap",
            "Deployment",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "Role",
            "RoleBinding",
            "Secret",  # the generated worker token
            "Service",
            "Service",
            "Service",  # the gateways' admin port, for the scraper
            "ServiceAccount",
            "StatefulSet",
        ]
    )
    app_version = chart.metadata["appVersion"]

    gateway = one(docs, "Deployment", "gateway")
    assert gateway["spec"]["replicas"] == 2
    gc = container(gateway)
    assert gc["image"] == f"ghcr.io/kvgate/kvgate-gateway:{app_version}"
    workers_svc = one(docs, "Service", "worker")
    assert workers_svc["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in workers_svc["spec"]["ports"]} == {"http", "kv-events", "kv-replay"}
    # The gateway watches exactly the slices of the workers' Service, in its own namespace.
    svc_name = workers_svc["metadata"]["name"]
    assert f"--k8s-selector=kubernetes.io/service-name={svc_name}" in gc["args"]
    assert "--k8s-namespace=$(POD_NAMESPACE)" in gc["args"]
    assert any(e["name"] == "POD_NAMESPACE" for e in gc["env"])
    assert gateway["spec"]["template"]["spec"]["serviceAccountName"] == "kvgate-gateway"

    role = one(docs, "Role")
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = one(docs, "RoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvgate-gateway", "namespace": "inference"}
    ]

    sts = one(docs, "StatefulSet", "worker")
    wc = container(sts)
    assert wc["image"] == f"ghcr.io/kvgate/kvgate-worker:{app_version}"
    assert sts["spec"]["serviceName"] == svc_name
    for flag in ("--port=8000", "--kv-events-port=5557", "--kv-events-replay-port=5558"):
        assert flag in wc["args"]
    assert "--model=/models/llava-1.5-7b-hf" in wc["args"]
    assert wc["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert wc[probe]["httpGet"] == {"path": "/health", "port": "http"}
    vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert vols["models"]["persistentVolumeClaim"]["claimName"] == "kvgate-models"

    for workload in (gateway, sts):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        sc = container(workload)["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"] for m in container(workload)["volumeMounts"]}
        assert "/tmp" in mounts

    dashboard = one(docs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (CHART / "dashboards" / "kvgate.json").read_text()
    assert json.loads(dashboard["data"]["kvgate.json"]) == json.loads(shipped)


def test_cpu_demo_values(chart: Any) -> None:
    docs = render(chart, load_values("values-cpu-demo.yaml"))
    validate_all(docs)
    assert "nvidia.com/gpu" not in json.dumps(docs)
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    sts = one(docs, "StatefulSet", "worker")
    wc = container(sts)
    assert {"--model=demo", "--device=cpu", "--engine=torch", "--served-model-name=demo"} <= set(
        wc["args"]
    )
    # The demo model is generated into the writable cache emptyDir; there is no model volume.
    assert {"name": "KVGATE_CACHE_DIR", "value": "/var/cache/kvgate"} in wc["env"]
    assert "models" not in {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert "volumeClaimTemplates" not in sts["spec"]
    assert one(docs, "Deployment", "gateway")["spec"]["replicas"] == 1


def test_all_options_on(chart: Any) -> None:
    docs = render(chart, load_values("ci/all-on-values.yaml"))
    validate_all(docs)
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sorted(m["metadata"]["name"] for m in monitors) == ["kv-gateway", "kv-worker"]
    assert all(m["metadata"]["labels"]["release"] == "kube-prometheus-stack" for m in monitors)
    sts = one(docs, "StatefulSet", "worker")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    wc = container(sts)
    assert {"--max-model-len=8192", "--num-blocks=4096", "--no-prefix-caching"} <= set(wc["args"])
    gateway = one(docs, "Deployment", "gateway")
    assert container(gateway)["image"] == "registry.example.com/kvgate-gateway:0.1.0-rc1"
    assert "--policy=least_loaded" in container(gateway)["args"]
    assert gateway["spec"]["template"]["spec"]["serviceAccountName"] == "kvgate-discovery"
    assert one(docs, "Service", "gateway")["spec"]["type"] == "LoadBalancer"
    assert one(docs, "ConfigMap")["metadata"]["annotations"]["grafana_folder"] == "LLM serving"


@pytest.mark.parametrize(
    "bad",
    [
        {"worker": {"engine": "tensorrt"}},
        {"gateway": {"replicas": "two"}},
        {"gateway": {"policy": "fastest"}},
        {"worker": {"ports": {"http": 70000}}},
        {"worker": {"resources": {"limits": {"memory": "lots"}}}},
        {"model": {"path": "relative/path"}},
        {"gateway": {"unknownKnob": 1}},
    ],
)
def test_schema_rejects_bad_values(chart: Any, bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.render(bad, name="kvgate", namespace="inference")
    report = helm.lint(CHART, bad)
    assert report["errors"], report


def test_lint_clean_and_model_source_required(chart: Any) -> None:
    for values in (None, load_values("values-cpu-demo.yaml"), load_values("ci/all-on-values.yaml")):
        assert helm.lint(CHART, values, strict=True)["errors"] == []
    with pytest.raises(helm.HelmRenderError, match="model"):
        chart.render({"model": {"existingClaim": ""}}, name="kvgate", namespace="inference")


def test_manifests_match_fresh_render_and_validate() -> None:
    spec = importlib.util.spec_from_file_location(
        "kvgate_manifests_render", MANIFESTS / "render.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = module.render()
    on_disk = {p.name: p.read_text() for p in MANIFESTS.glob("*.yaml")}
    assert on_disk == fresh, "manifests/ is stale: run .venv/bin/python manifests/render.py"

    kustomization = yaml.safe_load(on_disk["kustomization.yaml"])
    assert sorted(kustomization["resources"]) == sorted(set(on_disk) - {"kustomization.yaml"})
    docs = [
        d for name in kustomization["resources"] for d in yaml.safe_load_all(on_disk[name]) if d
    ]
    validate_all(docs)
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "Role", "ConfigMap"}


def dashboard_exprs() -> list[str]:
    dash = json.loads((CHART / "dashboards" / "kvgate.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def dashboard_metric_names() -> set[str]:
    names: set[str] = set()
    for expr in dashboard_exprs():
        names |= set(re.findall(r"\b(?:vllm:[a-z0-9_:]+|kvgate_[a-z0-9_]+)\b", expr))
    return names


def test_dashboard_shape_and_names() -> None:
    dash = json.loads((CHART / "dashboards" / "kvgate.json").read_text())
    (var,) = dash["templating"]["list"]
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"] and all(t["expr"] for t in p["targets"])
    names = dashboard_metric_names()
    for required in (
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "kvgate_predicted_cached_tokens_total",
        "kvgate_reported_cached_tokens_total",
        "kvgate_requests_total",
        "kvgate_routing_decision_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "kvgate_index_blocks",
        "kvgate_event_gaps_total",
        "kvgate_event_resyncs_total",
        "kvgate_replica_healthy",
    ):
        assert required in names
