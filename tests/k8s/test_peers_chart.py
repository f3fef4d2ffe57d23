"""The chart wires the gateway peers (gateway.peers): the gateway and EPP replicas are one group,
each finding the others by a pod label through the API (RBAC to list pods), on one peer port
the NetworkPolicy opens to that group only. Rendered by Helm's engine."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.cli import build_parser, config_from_args
from tests.k8s.test_epp_chart import chart, one, render, validate_all  # noqa: F401 (a fixture)

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")

PODS_RULE = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}


def _config(deployment: dict[str, Any]):
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    argv = [a.replace("$(POD_NAMESPACE)", "inference") for a in c["args"]]
    return c, config_from_args(build_parser().parse_args(argv))


def _selects(selector: str, labels: dict[str, str]) -> bool:
    terms = [t.partition("=") for t in selector.split(",")]
    return all(labels.get(k) == v for k, _, v in terms)


def test_gateway_and_epp_replicas_are_one_peer_group(chart: Any) -> None:  # noqa: F811
    docs = render(chart, {"epp": {"enabled": True}})
    validate_all(docs)
    pods = {}
    for component in ("gateway", "epp"):
        deployment = one(docs, "Deployment", component)
        c, config = _config(deployment)
        assert config.peer_port == 9100 and config.peer_timeout == 1.0
        assert config.k8s_namespace == "inference"
        # The port is the one the container names, and every pod of both kinds carries the label.
        assert {"name": "peers", "containerPort": 9100, "protocol": "TCP"} in c["ports"]
        pods[component] = deployment["spec"]["template"]["metadata"]["labels"]
        assert config.peers_from_kubernetes is not None
        selector = config.peers_from_kubernetes
        assert all(_selects(selector, labels) for labels in pods.values())
    # ... and no worker pod: a worker is never taken for a peer.
    workers = one(docs, "StatefulSet", "worker")["spec"]["template"]["metadata"]["labels"]
    assert not _selects(selector, workers)

    assert PODS_RULE in one(docs, "Role")["rules"]
    # The peer port is open to the group alone (the admin port's rule is the scraper's).
    for component in ("gateway", "epp"):
        policy = one(docs, "NetworkPolicy", component)
        rules = [r for r in policy["spec"]["ingress"] if {"port": "peers", "protocol": "TCP"}
                 in r.get("ports", [])]  # fmt: skip
        (rule,) = rules
        (source,) = rule["from"]
        assert set(source) == {"podSelector"}
        assert _selects(selector, source["podSelector"]["matchLabels"])
        assert source["podSelector"]["matchLabels"].items() <= pods[component].items()


def test_peers_off_leaves_no_trace(chart: Any) -> None:  # noqa: F811
    docs = render(chart, {"gateway": {"peers": {"enabled": False}}})
    validate_all(docs)
    c, config = _config(one(docs, "Deployment", "gateway"))
    assert config.peer_port is None and config.peers_from_kubernetes is None
    assert "peers" not in {p["name"] for p in c["ports"]}
    assert PODS_RULE not in one(docs, "Role")["rules"]  # the gateway alone lists no pods
    policy = one(docs, "NetworkPolicy", "gateway")
    assert all("peers" not in str(r) for r in policy["spec"]["ingress"])


def test_schema_rejects_a_bad_peer_port(chart: Any) -> None:  # noqa: F811
    with pytest.raises(Exception, match="port"):
        render(chart, {"gateway": {"peers": {"port": 0}}})
