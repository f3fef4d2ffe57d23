"""The Helm chart and manifests/: rendered by Helm's engine, checked against Kubernetes schemas."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support.paths import CHART, REPO

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")

MANIFESTS = REPO / "manifests"
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
            "NetworkPolicy",  # the gateways' (their admin port), besides the workers'
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
        },
        # its peers, the release's other gateway pods (gateway.peers: tests/k8s/test_peers_chart.py)
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
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


# KVEventsConfig's fields in vLLM 0.33.0 (vllm/config/kv_events.py).
VLLM_KV_EVENTS_FIELDS = {
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
}


def vllm_flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


@pytest.mark.parametrize("dp", [1, 2])
def test_vllm_values(chart: Any, dp: int) -> None:
    """vLLM as the worker, and a gateway that follows it: the ports, rank offsets and topic the
    gateway derives from the rendered objects are the ones vLLM's rendered flags publish on."""
    from gateway.discovery.endpoints import format_topic
    from gateway.discovery.k8s import worker_endpoints
    from gateway.fleet.ranks import vllm_ranks

    values = load_values("values-vllm.yaml")
    values["worker"]["vllm"]["dataParallelSize"] = dp
    docs = render(chart, values)
    validate_all(docs)
    assert helm.lint(CHART, values, strict=True)["errors"] == []
    sts = one(docs, "StatefulSet", "worker")
    wc = container(sts)
    assert wc["image"] == "vllm/vllm-openai:v0.33.0" and wc["command"] == ["vllm", "serve"]
    args = wc["args"]
    assert {"--enable-prefix-caching", "--prefix-caching-hash-algo=sha256_cbor"} <= set(args)
    assert vllm_flag(args, "--block-size") == "16"
    assert ("--data-parallel-size=2" in args) == (dp == 2)
    kv = json.loads(vllm_flag(args, "--kv-events-config"))
    assert set(kv) <= VLLM_KV_EVENTS_FIELDS
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    assert (kv["endpoint"], kv["replay_endpoint"]) == ("tcp://*:5557", "tcp://*:5657")
    assert kv["topic"] == "kv@$(POD_NAME)@Qwen2.5-7B-Instruct"
    env = {e["name"]: e for e in wc["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "PYTHONHASHSEED" not in env  # the gateway re-keys blocks itself (docs/kubernetes.md)
    # vLLM's API key is the worker token the gateways send (workerAuth is on by default).
    token_ref = env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert token_ref == {"name": "kvgate-worker-token", "key": "token"}
    assert wc["securityContext"]["readOnlyRootFilesystem"] is True

    gateway = one(docs, "Deployment", "gateway")
    gc = container(gateway)
    assert "--model-dir=/models/Qwen2.5-7B-Instruct" in gc["args"]
    models = {m["name"]: m for m in gc["volumeMounts"]}["models"]
    assert models == {"name": "models", "mountPath": "/models", "readOnly": True}
    vols = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    assert vols["models"]["persistentVolumeClaim"]["claimName"] == "kvgate-models"

    # The EndpointSlice Kubernetes makes from the worker Service, for pod kvgate-worker-0.
    svc = one(docs, "Service", "worker")
    pod = "kvgate-worker-0"
    slice_ = {
        "addressType": "IPv4",
        "ports": [{"name": p["name"], "port": p["port"]} for p in svc["spec"]["ports"]],
        "endpoints": [{"addresses": ["10.1.2.3"], "targetRef": {"kind": "Pod", "name": pod}}],
    }
    (endpoint,) = worker_endpoints([slice_], "http")
    topic = vllm_flag(gc["args"], "--vllm-kv-events-topic")
    ranks = vllm_ranks(
        list(range(dp)), endpoint, port=None, replay_port=None, topic=topic,
        model="Qwen2.5-7B-Instruct", connect=False,
    )  # fmt: skip
    published = kv["topic"].replace("$(POD_NAME)", pod)
    assert [(r.kv_events.port, r.kv_events.replay_port, r.kv_events.topic) for r in ranks] == [
        (5557 + r, 5657 + r, published) for r in range(dp)
    ]
    assert format_topic(topic, "10.1.2.3", 8000, pod, "Qwen2.5-7B-Instruct") == published
    policy = one(docs, "NetworkPolicy", "worker")["spec"]["ingress"][0]["ports"]
    if dp == 1:
        assert {"port": "kv-events", "protocol": "TCP"} in policy
    else:
        assert {"port": 5557, "endPort": 5558, "protocol": "TCP"} in policy
        assert {"port": 5657, "endPort": 5658, "protocol": "TCP"} in policy


def test_vllm_values_with_the_endpoint_picker(chart: Any) -> None:
    """The EPP discovers vLLM pods from an InferencePool, which names no events ports: it gets
    them, the tokenizer volume and the topic from the same flags as the HTTP gateway."""
    values = load_values("values-vllm.yaml")
    values["epp"] = {"enabled": True}
    values["workerAuth"] = {"enabled": False}
    docs = render(chart, values)  # (the EPP's manifests: tests/k8s/test_epp_chart.py)
    for component in ("gateway", "epp"):
        c = container(one(docs, "Deployment", component))
        assert vllm_flag(c["args"], "--model-dir") == "/models/Qwen2.5-7B-Instruct"
        assert vllm_flag(c["args"], "--vllm-kv-events-port") == "5557"
        assert vllm_flag(c["args"], "--vllm-kv-events-replay-port") == "5657"
        assert vllm_flag(c["args"], "--vllm-kv-events-topic") == "kv@{pod}@{model}"
        assert {m["name"] for m in c["volumeMounts"]} >= {"models"}
    wc = container(one(docs, "StatefulSet", "worker"))
    assert "VLLM_API_KEY" not in {e["name"] for e in wc["env"]}


@pytest.mark.parametrize(
    "values, message",
    [
        ({"worker": {"vllm": {"dataParallelSize": 2}, "ports": {"kvReplay": 5558}}}, "overlap"),
        ({"model": {"claimTemplate": {"enabled": True}}}, "gateway reads its tokenizer"),
    ],
)
def test_vllm_values_refused(chart: Any, values: dict[str, Any], message: str) -> None:
    base = load_values("values-vllm.yaml")
    for key, sub in values.items():
        for k, v in sub.items():
            base[key][k] = {**base[key].get(k, {}), **v} if isinstance(v, dict) else v
    with pytest.raises(helm.HelmRenderError, match=message):
        chart.render(base, name="kvgate", namespace="inference")


@pytest.mark.parametrize(
    "bad",
    [
        {"worker": {"engine": "tensorrt"}},
        {"worker": {"kind": "sglang"}},
        {"worker": {"vllm": {"hashAlgo": "md5"}}},
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
    assert on_disk == fresh, "manifests/ is stale: run .venv/bin/python manifests/render.py --write"

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
