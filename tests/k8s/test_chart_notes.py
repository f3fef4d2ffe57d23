"""The install notes (NOTES.txt) send a user to what the same release renders: the gateway's
Service or, with no gateway, the Gateway the HTTPRoute attaches to; the worker token's Secret
where workers want it; only the metrics the worker kind exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.support.paths import CHART

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")

EPP_ONLY = {"gateway": {"replicas": 0}, "epp": {"enabled": True}}


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(CHART) as c:
        yield c


def install(chart: Any, values: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The notes and the objects of one install of release `kvgate` in `inference`."""
    out = chart.render(values, name="kvgate", namespace="inference", is_install=True)
    notes = next(text for name, text in out.items() if name.endswith("NOTES.txt"))
    docs = [
        d
        for name, text in out.items()
        if not name.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
        if d
    ]
    return notes, docs


def named(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def request_body(notes: str) -> dict[str, Any]:
    (body,) = re.findall(r"-d '(.*)'", notes)
    return json.loads(body)


def test_the_default_notes_port_forward_the_gateway_and_send_the_token(chart) -> None:
    notes, docs = install(chart, {})
    (svc,) = re.findall(r"port-forward svc/(\S+) 8080:(\d+)", notes)
    service = named(docs, "Service")[svc[0]]
    assert int(svc[1]) in [p["port"] for p in service["spec"]["ports"]]
    (worker,) = named(docs, "StatefulSet").values()
    args = worker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--served-model-name={request_body(notes)['model']}" in args
    (secret, key) = re.findall(r"get secret (\S+) -o jsonpath='\{\.data\.(\w+)\}'", notes)[0]
    assert key in named(docs, "Secret")[secret]["data"], "the notes' Secret and key exist"
    assert "kvgate_worker_*" in notes


def test_open_metrics_need_no_token(chart) -> None:
    notes, _ = install(chart, {"workerAuth": {"unauthenticatedMetrics": True}})
    assert "Authorization" not in notes


def test_without_a_gateway_the_notes_point_at_the_httproutes_gateway(chart) -> None:
    notes, docs = install(chart, EPP_ONLY)
    assert "port-forward" not in notes and "<gateway-pod>" not in notes
    (route,) = named(docs, "HTTPRoute").values()
    (parent,) = route["spec"]["parentRefs"]
    assert f"get gateway {parent['name']} " in notes
    assert "(InferencePool kvgate)" in notes and "kvgate" in named(docs, "InferencePool")
    assert request_body(notes)["messages"]


def test_vllm_workers_export_only_vllms_metrics(chart) -> None:
    notes, _ = install(chart, yaml.safe_load((CHART / "values-vllm.yaml").read_text()))
    assert "kvgate_worker_" not in notes and "vllm:* (vLLM's own)" in notes
