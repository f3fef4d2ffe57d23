"""The chart in EPP mode: kvgate as the endpoint picker of an InferencePool.

The InferencePool is validated against the CRD's own schema, vendored from the inference
extension's v1.6.0 release (tests/fixtures/crds/), made strict (an unknown field fails, as kubectl's
strict field validation would), with its two CEL rules checked here; the HTTPRoute against the
fields of the Gateway API's v1 HTTPRoute the chart uses; everything else against the Kubernetes
OpenAPI schemas, as tests/k8s/test_chart.py does.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.cli import build_parser, config_from_args
from tests.support.paths import CHART, FIXTURES

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")

CRD = FIXTURES / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
K8S_VERSION = kubernetes_validate.latest_version()

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
HTTPROUTE_SCHEMA = {  # the fields of gateway.networking.k8s.io/v1 HTTPRoute the chart emits
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "parentRefs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "additionalProperties": False,
                        "properties": {
                            "group": {"type": "string"},
                            "kind": {"type": "string"},
                            "name": _NAME,
                            "namespace": {"type": "string", "maxLength": 63},
                            "sectionName": {"type": "string", "maxLength": 253},
                        },
                    },
                },
                "hostnames": {"type": "array", "items": {"type": "string"}},
                "rules": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matches": {"type": "array", "items": {"type": "object"}},
                            "backendRefs": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["name"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "group": {"type": "string"},
                                        "kind": {"type": "string"},
                                        "name": _NAME,
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


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The structural schema with unknown fields refused (the API server would prune them)."""
    out = copy.deepcopy(schema)

    def walk(node: dict[str, Any]) -> None:
        if node.get("type") == "object" and "properties" in node:
            node.setdefault("additionalProperties", False)
        for child in node.get("properties", {}).values():
            walk(child)
        if isinstance(node.get("items"), dict):
            walk(node["items"])
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"])

    walk(out)
    return out


def pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == "v1.6.0"
    return strict(version["schema"]["openAPIV3Schema"])


def check_pool(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(doc, pool_schema())
    spec = doc["spec"]
    # The CRD's CEL rules (x-kubernetes-validations), which JSON Schema cannot express.
    ref = spec["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref  # port required for Service
    numbers = [p["number"] for p in spec["targetPorts"]]
    assert len(numbers) == len(set(numbers))  # port number must be unique


def validate_all(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["kind"] == "InferencePool":
            check_pool(doc)
        elif doc["kind"] == "HTTPRoute":
            jsonschema.validate(doc, HTTPROUTE_SCHEMA)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(CHART) as c:
        yield c


def render(chart: Any, values: dict[str, Any] | None) -> list[dict[str, Any]]:
    out = chart.render(values, name="kvgate", namespace="inference", is_install=True)
    return [
        d
        for template, text in out.items()
        if not template.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
        if d
    ]


def one(docs: list[dict[str, Any]], kind: str, component: str | None = None) -> dict[str, Any]:
    found = [
        d
        for d in docs
        if d["kind"] == kind
        and component in (None, d["metadata"]["labels"]["app.kubernetes.io/component"])
    ]
    assert len(found) == 1, f"{kind}/{component}: {len(found)}"
    return found[0]


def ci_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "ci" / "epp-values.yaml").read_text())


def test_vendored_crd_rejects_what_it_should() -> None:
    schema = pool_schema()
    good = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "p"},
        "spec": {
            "selector": {"matchLabels": {"app": "w"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        },
    }
    jsonschema.validate(good, schema)
    bad_specs = [
        {**good["spec"], "targetPorts": []},  # at least one port
        {**good["spec"], "selector": {"matchLabels": {}}},  # at least one label
        {**good["spec"], "endpointPickerRef": {"name": "epp", "failureMode": "Sometimes"}},
        {**good["spec"], "extensionRef": {"name": "epp"}},  # the v1alpha2 field name
    ]
    for spec in bad_specs:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**good, "spec": spec}, schema)


@pytest.mark.parametrize("values", ["minimal", "ci"])
def test_epp_mode_renders_valid_objects(chart: Any, values: str) -> None:
    v = {"epp": {"enabled": True}} if values == "minimal" else ci_values()
    docs = render(chart, v)
    validate_all(docs)
    pool = one(docs, "InferencePool")
    epp = one(docs, "Deployment", "epp")
    svc = one(docs, "Service", "epp")
    sts = one(docs, "StatefulSet", "worker")

    # The pool selects exactly the worker pods, on their HTTP port.
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (worker,) = sts["spec"]["template"]["spec"]["containers"]
    http = next(p["containerPort"] for p in worker["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http}]
    # Its endpoint picker is the EPP Service, whose port reaches the EPP pods' gRPC port.
    ref = pool["spec"]["endpointPickerRef"]
    grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc-ext-proc")
    assert ref["name"] == svc["metadata"]["name"] and ref["port"]["number"] == grpc_port["port"]
    pod_labels = epp["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (c,) = epp["spec"]["template"]["spec"]["containers"]
    assert grpc_port["targetPort"] in {p["name"] for p in c["ports"]}
    assert ref["failureMode"] == ("FailOpen" if values == "ci" else "FailClose")

    # The EPP runs the gateway program: its flags parse, and it reads the pool named above.
    argv = [a.replace("$(POD_NAMESPACE)", "inference") for a in c["args"]]
    config = config_from_args(build_parser().parse_args(argv))
    assert config.epp and config.discovery == "inferencepool"
    assert config.inference_pool == pool["metadata"]["name"]
    assert config.k8s_namespace == "inference"
    # /metrics and /kvgate/index on the admin port, off the EPP Service (its NetworkPolicy and
    # scrape: tests/k8s/test_chart_security.py).
    assert config.admin_port == next(p["containerPort"] for p in c["ports"] if p["name"] == "admin")
    assert "admin" not in {p["targetPort"] for p in svc["spec"]["ports"]}
    # ... with the HTTP gateway's own front-door flags (limits, overload, API keys).
    (gw,) = one(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    front = [a for a in gw["args"] if a.startswith(("--max-", "--api-keys", "--queue"))]
    assert front and all(a in c["args"] for a in front)

    # RBAC: read its pool and the pods, besides the gateway's EndpointSlices; nothing more.
    rules = one(docs, "Role")["rules"]
    assert {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"]} in rules  # fmt: skip
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]} in rules
    assert all(set(r["verbs"]) == {"get", "list", "watch"} for r in rules)
    sa = epp["spec"]["template"]["spec"]["serviceAccountName"]
    assert one(docs, "RoleBinding")["subjects"][0]["name"] == sa

    route = one(docs, "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool",
         "name": pool["metadata"]["name"]}
    ]  # fmt: skip
    parent = route["spec"]["parentRefs"][0]
    assert parent["kind"] == "Gateway" and parent["name"] == "inference-gateway"

    tls = values == "ci"
    assert ("--epp-tls-cert-file=/etc/kvgate/epp-tls/tls.crt" in c["args"]) is tls
    probe = c["readinessProbe"]
    assert ("grpc" in probe) is not tls  # Kubernetes' gRPC probe speaks plaintext only
    if not tls:
        assert probe["grpc"] == {"port": grpc_port["port"], "service": "readiness"}


def test_epp_off_by_default(chart: Any) -> None:
    kinds = {d["kind"] for d in render(chart, None)}
    assert not kinds & {"InferencePool", "HTTPRoute"}
    assert not [d for d in render(chart, None) if d["metadata"]["name"].endswith("-epp")]


def test_schema_rejects_bad_epp_values(chart: Any) -> None:
    for bad in (
        {"epp": {"enabled": True, "failureMode": "Sometimes"}},
        {"epp": {"enabled": True, "grpcPort": 0}},
        {"epp": {"enabled": True, "httpRoute": {"pathPrefix": "v1"}}},
        {"epp": {"enabled": True, "pool": {"name": "Not_A_Name"}}},
        {"epp": {"enabeld": True}},
    ):
        with pytest.raises(helm.HelmValuesError):
            chart.render(bad, name="kvgate", namespace="inference", is_install=True)


def test_lint_clean_in_epp_mode() -> None:
    for values in ({"epp": {"enabled": True}}, ci_values()):
        assert helm.lint(CHART, values, strict=True)["errors"] == []
