"""The chart's security values reach the gateway (its rendered args parse into the config), its
NetworkPolicies let only the gateways and the metrics scraper reach the workers, and only the
scraper reach the admin port of the gateways and the EPPs."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.cli import build_parser, config_from_args
from tests.support.paths import CHART

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")


def _render(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name="kvgate", namespace="inference", is_install=True)
    return [
        doc
        for template, text in out.items()
        if not template.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def _gateway(values: dict[str, Any] | None) -> dict[str, Any]:
    for doc in _render(values):
        if doc["kind"] == "Deployment" and "gateway" in doc["metadata"]["name"]:
            return doc
    raise AssertionError("no gateway Deployment")


def _config(dep: dict[str, Any]):
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(POD_NAMESPACE)", "inference") for a in c["args"]]
    return c, config_from_args(build_parser().parse_args(args))


def test_default_chart_args_match_cli_defaults() -> None:
    _, cfg = _config(_gateway(None))
    defaults = config_from_args(build_parser().parse_args([]))
    assert cfg.limits == defaults.limits
    assert (cfg.max_inflight_per_replica, cfg.max_queue, cfg.queue_timeout) == (256, 1024, 30.0)
    assert cfg.api_keys_file is None and cfg.remote_images
    assert cfg.image_fetch_max_bytes == defaults.image_fetch_max_bytes
    assert cfg.image_fetch_timeout == defaults.image_fetch_timeout
    assert cfg.allow_image_uuids is False


def test_auth_secret_limits_and_fetch_values() -> None:
    values = {
        "auth": {"existingSecret": "api-keys", "secretKey": "keys.yaml", "saltSecretKey": "salt"},
        "gateway": {
            "limits": {
                "maxPromptTokens": 4096,
                "maxN": 4,
                "maxJsonDepth": 32,
                "bodyReadTimeoutSeconds": 7.5,
                "bodyReadBudget": 2**30,
            },
            "imageFetch": {
                "remoteImages": False,
                "allow": ["images.internal", "10.1.0.0/16"],
                "maxBytes": 1000,
                "allowClientUuids": True,
            },
            "overload": {"maxInflightPerReplica": 0, "maxQueue": 10, "queueTimeoutSeconds": 2},
        },
    }
    dep = _gateway(values)
    c, cfg = _config(dep)
    assert cfg.api_keys_file == "/etc/kvgate/auth/keys.yaml"
    assert cfg.limits.max_prompt_tokens == 4096 and cfg.limits.max_n == 4
    assert not cfg.remote_images
    assert cfg.image_fetch_allow == ("images.internal", "10.1.0.0/16")
    assert cfg.limits.max_json_depth == 32
    assert (cfg.limits.body_read_timeout, cfg.limits.body_read_budget) == (7.5, 2**30)
    assert cfg.image_fetch_max_bytes == 1000 and cfg.allow_image_uuids
    assert cfg.max_inflight_per_replica is None and cfg.max_queue == 10
    (salt,) = [e for e in c["env"] if e["name"] == "KVGATE_TENANT_SALT_SECRET"]
    assert salt["valueFrom"]["secretKeyRef"] == {"name": "api-keys", "key": "salt"}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "api-keys")
    assert mount["mountPath"] == "/etc/kvgate/auth" and "subPath" not in mount
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys")
    assert vol["secret"]["secretName"] == "api-keys"


# ---- NetworkPolicy -----------------------------------------------------------------------


def _kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _policy(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    """The NetworkPolicy on one component's pods (the workers' or the gateways')."""
    (found,) = [
        d
        for d in _kind(docs, "NetworkPolicy")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    return found


def _pod_labels(docs: list[dict[str, Any]], kind: str) -> dict[str, str]:
    (workload,) = _kind(docs, kind)
    return workload["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, selector
    return selector["matchLabels"].items() <= labels.items()


def test_only_gateways_and_the_scraper_reach_the_workers() -> None:
    docs = _render(None)
    policy = _policy(docs, "worker")
    kubernetes_validate.validate(policy, kubernetes_validate.latest_version(), strict=True)
    workers, gateways = _pod_labels(docs, "StatefulSet"), _pod_labels(docs, "Deployment")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]  # an Ingress policy: all else is denied
    assert _selects(spec["podSelector"], workers) and not _selects(spec["podSelector"], gateways)

    gateway_rule, scraper_rule = spec["ingress"]
    (peer,) = gateway_rule["from"]
    assert set(peer) == {"podSelector"}  # this namespace only
    assert _selects(peer["podSelector"], gateways) and not _selects(peer["podSelector"], workers)
    # Every port the worker listens on, by the names its container gives them.
    (sts,) = _kind(docs, "StatefulSet")
    (worker,) = sts["spec"]["template"]["spec"]["containers"]
    names = {p["name"] for p in worker["ports"]}
    assert names == {"http", "kv-events", "kv-replay"}
    assert {p["port"] for p in gateway_rule["ports"]} == names

    (scraper,) = scraper_rule["from"]
    assert scraper["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
    }
    assert scraper["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    assert [p["port"] for p in scraper_rule["ports"]] == ["http"]  # /metrics, not the events


def test_network_policy_switches() -> None:
    assert _kind(_render({"networkPolicy": {"enabled": False}}), "NetworkPolicy") == []
    values = {
        "networkPolicy": {
            "metricsScraper": {
                # Helm merges maps into the defaults: null drops a default label.
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": None, "team": "obs"}
                },
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": None, "app": "vmagent"}},
            },
            "extraIngress": [{"from": [{"podSelector": {"matchLabels": {"app": "debug"}}}]}],
        }
    }
    policy = _policy(_render(values), "worker")
    kubernetes_validate.validate(policy, kubernetes_validate.latest_version(), strict=True)
    _, scraper, extra = policy["spec"]["ingress"]
    assert scraper["from"][0]["podSelector"] == {"matchLabels": {"app": "vmagent"}}
    assert scraper["from"][0]["namespaceSelector"] == {"matchLabels": {"team": "obs"}}
    assert extra == {"from": [{"podSelector": {"matchLabels": {"app": "debug"}}}]}
    off = {"networkPolicy": {"metricsScraper": {"enabled": False}}}
    policy = _policy(_render(off), "worker")
    assert len(policy["spec"]["ingress"]) == 1


def test_network_policy_values_are_checked() -> None:
    with pytest.raises(helm.HelmValuesError):
        _render({"networkPolicy": {"enabled": "yes"}})
    with pytest.raises(helm.HelmValuesError):
        _render({"networkPolicy": {"metricsScraper": {"podSelector": {"app": "x"}}}})


# ---- the worker token and the admin port (findings 1 and 8) --------------------------------


def _one(docs: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    (found,) = [
        d
        for d in docs
        if d["kind"] == kind and d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    return found


def _token_env(workload: dict[str, Any]) -> dict[str, Any] | None:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    found = [e for e in c.get("env", []) if e["name"] == "KVGATE_WORKER_TOKEN"]
    return found[0]["valueFrom"]["secretKeyRef"] if found else None


def _worker_config(sts: dict[str, Any], token: str | None, monkeypatch) -> Any:
    from kvgate_cli.flags import config_from_flags
    from worker.cli import build_parser
    from worker.server.config import ServerConfig

    (c,) = sts["spec"]["template"]["spec"]["containers"]
    if token is None:
        monkeypatch.delenv("KVGATE_WORKER_TOKEN", raising=False)
    else:
        monkeypatch.setenv("KVGATE_WORKER_TOKEN", token)
    return config_from_flags(ServerConfig, build_parser().parse_args(c["args"]))


def test_the_chart_generates_a_worker_token_and_wires_it_everywhere(monkeypatch) -> None:
    import base64

    docs = _render({"metrics": {"serviceMonitor": {"enabled": True}}})
    (secret,) = _kind(docs, "Secret")
    kubernetes_validate.validate(secret, kubernetes_validate.latest_version(), strict=True)
    token = base64.b64decode(secret["data"]["token"]).decode()
    ref = {"name": secret["metadata"]["name"], "key": "token"}
    gateway, sts = _one(docs, "Deployment", "gateway"), _one(docs, "StatefulSet", "worker")
    assert _token_env(gateway) == ref and _token_env(sts) == ref
    # What the processes make of it: both take the token, the worker opens /health only.
    monkeypatch.setenv("KVGATE_WORKER_TOKEN", token)
    assert _config(gateway)[1].worker_token == token
    worker = _worker_config(sts, token, monkeypatch)
    assert worker.worker_token == token and worker.open_paths == {"/health"}
    # Two installs get two tokens (an upgrade keeps the installed one: `lookup`).
    (other,) = _kind(_render(None), "Secret")
    assert other["data"]["token"] != secret["data"]["token"]
    # The scraper sends it to the workers.
    monitor = next(
        m for m in _kind(docs, "ServiceMonitor") if m["metadata"]["name"].endswith("worker")
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": ref}


def test_an_existing_token_secret_and_unauthenticated_metrics(monkeypatch) -> None:
    values = {
        "workerAuth": {
            "existingSecret": "ops-token",
            "secretKey": "t",
            "unauthenticatedMetrics": True,
        },
        "metrics": {"serviceMonitor": {"enabled": True}},
    }
    docs = _render(values)
    assert _kind(docs, "Secret") == []
    gateway, sts = _one(docs, "Deployment", "gateway"), _one(docs, "StatefulSet", "worker")
    assert _token_env(gateway) == _token_env(sts) == {"name": "ops-token", "key": "t"}
    worker = _worker_config(sts, "x" * 32, monkeypatch)
    assert worker.open_paths == {"/health", "/metrics"}
    for monitor in _kind(docs, "ServiceMonitor"):
        (endpoint,) = monitor["spec"]["endpoints"]
        assert "authorization" not in endpoint


def test_worker_auth_can_be_turned_off(monkeypatch) -> None:
    docs = _render({"workerAuth": {"enabled": False}})
    assert _kind(docs, "Secret") == []
    sts = _one(docs, "StatefulSet", "worker")
    assert _token_env(_one(docs, "Deployment", "gateway")) is None and _token_env(sts) is None
    assert _worker_config(sts, None, monkeypatch).worker_token is None


def test_admin_port_is_scraped_but_not_in_the_clients_service() -> None:
    docs = _render({"metrics": {"serviceMonitor": {"enabled": True}}})
    gateway = _one(docs, "Deployment", "gateway")
    c, cfg = _config(gateway)
    assert cfg.admin_port == 9090
    assert {"name": "admin", "containerPort": 9090, "protocol": "TCP"} in c["ports"]
    public = _one(docs, "Service", "gateway")
    assert [p["targetPort"] for p in public["spec"]["ports"]] == ["http"]
    admin = _one(docs, "Service", "gateway-admin")
    kubernetes_validate.validate(admin, kubernetes_validate.latest_version(), strict=True)
    assert admin["spec"]["clusterIP"] == "None"
    assert [p["targetPort"] for p in admin["spec"]["ports"]] == ["admin"]
    pod_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert admin["spec"]["selector"].items() <= pod_labels.items()
    monitor = next(
        m for m in _kind(docs, "ServiceMonitor") if m["metadata"]["name"].endswith("gateway")
    )
    assert _selects(monitor["spec"]["selector"], admin["metadata"]["labels"])
    assert not _selects(monitor["spec"]["selector"], public["metadata"]["labels"])
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["admin"]
    # Without an admin port: scraped on the public port, as before.
    docs = _render(
        {"gateway": {"adminPort": None}, "metrics": {"serviceMonitor": {"enabled": True}}}
    )
    assert _config(_one(docs, "Deployment", "gateway"))[1].admin_port is None
    assert not [d for d in _kind(docs, "Service") if "admin" in d["metadata"]["name"]]
    monitor = next(
        m for m in _kind(docs, "ServiceMonitor") if m["metadata"]["name"].endswith("gateway")
    )
    assert _selects(
        monitor["spec"]["selector"], _one(docs, "Service", "gateway")["metadata"]["labels"]
    )
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http"]


ANYONE = "any source"
DEFAULT_SCRAPER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


def _admitted(policy: dict[str, Any], port: dict[str, Any]) -> str | list[dict[str, Any]]:
    """Whom a policy's ingress rules admit to one container port, as Kubernetes reads them: a
    rule without `ports` covers every port, one without `from` every source."""
    peers: list[dict[str, Any]] = []
    for rule in policy["spec"].get("ingress") or []:
        covers = not rule.get("ports") or any(
            p.get("port") in (None, port["name"], port["containerPort"])
            and p.get("protocol", "TCP") == port["protocol"]
            for p in rule["ports"]
        )
        if not covers:
            continue
        if not rule.get("from"):
            return ANYONE
        peers.extend(rule["from"])
    return peers


def _gateway_ports(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    (c,) = _one(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    return {p["name"]: p for p in c["ports"]}


def test_only_the_scraper_reaches_the_gateways_admin_port() -> None:
    """A pod that skips the Services still reaches a gateway pod's IP: the gateways' own
    NetworkPolicy keeps the public port open to all and the admin port to the scraper."""
    docs = _render({"metrics": {"serviceMonitor": {"enabled": True}}})
    policy = _policy(docs, "gateway")
    kubernetes_validate.validate(policy, kubernetes_validate.latest_version(), strict=True)
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]  # egress (workers, API server, images) untouched
    gateway = _one(docs, "Deployment", "gateway")["spec"]["template"]["metadata"]["labels"]
    assert _selects(spec["podSelector"], gateway)
    assert not _selects(spec["podSelector"], _pod_labels(docs, "StatefulSet"))

    ports = _gateway_ports(docs)
    # peers: the gateway.peers port, open to the peer group alone (tests/k8s/test_peers_chart.py)
    assert set(ports) == {"http", "admin", "peers"} and ports["admin"]["containerPort"] == 9090
    assert _admitted(policy, ports["http"]) == ANYONE  # clients, Ingress controllers, LBs
    # The admin port: the scraper alone, by the same selectors as on the workers' HTTP port.
    assert _admitted(policy, ports["admin"]) == [DEFAULT_SCRAPER]
    worker_http = {"name": "http", "containerPort": 8000, "protocol": "TCP"}
    assert _admitted(_policy(docs, "worker"), worker_http)[-1] == DEFAULT_SCRAPER
    # ... which are the ports the clients' Service and the scraper's Service send to.
    public, admin = _one(docs, "Service", "gateway"), _one(docs, "Service", "gateway-admin")
    assert [p["targetPort"] for p in public["spec"]["ports"]] == ["http"]
    assert [p["targetPort"] for p in admin["spec"]["ports"]] == ["admin"]
    monitor = next(
        m for m in _kind(docs, "ServiceMonitor") if m["metadata"]["name"].endswith("gateway")
    )
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["admin"]
    # The kubelet's probes use the public port, so the policy never stands in their way.
    (c,) = _one(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["port"] == "http"
    assert c["livenessProbe"]["tcpSocket"]["port"] == "http"


def test_gateway_policy_switches() -> None:
    # No admin port: /metrics is on the public port, which must stay open; no gateway policy.
    docs = _render({"gateway": {"adminPort": None}})
    assert _kind(docs, "NetworkPolicy") == [_policy(docs, "worker")]
    assert _kind(_render({"networkPolicy": {"enabled": False}}), "NetworkPolicy") == []

    # No scraper: the admin port takes no pod at all (no peerless rule that would admit all).
    docs = _render({"networkPolicy": {"metricsScraper": {"enabled": False}}})
    policy, ports = _policy(docs, "gateway"), _gateway_ports(docs)
    kubernetes_validate.validate(policy, kubernetes_validate.latest_version(), strict=True)
    assert _admitted(policy, ports["admin"]) == []
    assert _admitted(policy, ports["http"]) == ANYONE
    group = {"podSelector": {"matchLabels": {"kvgate.io/peer-group": "kvgate"}}}
    assert policy["spec"]["ingress"] == [
        {"ports": [{"port": "http", "protocol": "TCP"}]},
        {"from": [group], "ports": [{"port": "peers", "protocol": "TCP"}]},
    ]

    # Extra peers, alone or besides the scraper (whose selectors merge as on the workers).
    extra = [
        {"namespaceSelector": {"matchLabels": {"team": "obs"}}},
        {"ipBlock": {"cidr": "10.20.0.0/16"}},
    ]
    values = {
        "networkPolicy": {"metricsScraper": {"enabled": False}, "gatewayAdminExtraFrom": extra}
    }
    docs = _render(values)
    policy = _policy(docs, "gateway")
    kubernetes_validate.validate(policy, kubernetes_validate.latest_version(), strict=True)
    assert _admitted(policy, _gateway_ports(docs)["admin"]) == extra
    vmagent = {"matchLabels": {"app.kubernetes.io/name": None, "app": "vmagent"}}
    values = {
        "networkPolicy": {
            "metricsScraper": {"podSelector": vmagent},
            "gatewayAdminExtraFrom": extra[:1],
        }
    }
    docs = _render(values)
    scraper = {**DEFAULT_SCRAPER, "podSelector": {"matchLabels": {"app": "vmagent"}}}
    admitted = _admitted(_policy(docs, "gateway"), _gateway_ports(docs)["admin"])
    assert admitted == [scraper, extra[0]]

    # Another admin port number: the rule names the port, so it follows.
    docs = _render({"gateway": {"adminPort": 9100}})
    ports = _gateway_ports(docs)
    assert ports["admin"]["containerPort"] == 9100
    assert _admitted(_policy(docs, "gateway"), ports["admin"]) == [DEFAULT_SCRAPER]

    with pytest.raises(helm.HelmValuesError):
        _render({"networkPolicy": {"gatewayAdminExtraFrom": {"podSelector": {}}}})


def _epp_ports(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    (c,) = _one(docs, "Deployment", "epp")["spec"]["template"]["spec"]["containers"]
    return {p["name"]: p for p in c["ports"]}


def _policies_on(docs: list[dict[str, Any]], workload: dict[str, Any]) -> list[dict[str, Any]]:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return [p for p in _kind(docs, "NetworkPolicy") if _selects(p["spec"]["podSelector"], labels)]


def test_the_epps_admin_port_is_the_scrapers_alone() -> None:
    """The EPP runs the gateway program: with gateway.adminPort it serves /metrics and
    /kvgate/index on its own admin port, which the scraper scrapes and its NetworkPolicy keeps
    from every other pod; gRPC (the Gateway's proxy may be no pod) and http stay open to all."""
    docs = _render({"epp": {"enabled": True}, "metrics": {"serviceMonitor": {"enabled": True}}})
    epp = _one(docs, "Deployment", "epp")
    c, cfg = _config(epp)
    assert cfg.epp and cfg.admin_port == 9090 and "--admin-port=9090" in c["args"]
    ports = _epp_ports(docs)
    assert set(ports) == {"grpc", "http", "admin", "peers"}
    assert ports["admin"] == {"name": "admin", "containerPort": 9090, "protocol": "TCP"}

    # Scraped on the admin port, through a headless Service of its own; the EPP Service (the
    # InferencePool's endpointPickerRef) does not carry it.
    service = _one(docs, "Service", "epp")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["grpc", "http"]
    admin = _one(docs, "Service", "epp-admin")
    kubernetes_validate.validate(admin, kubernetes_validate.latest_version(), strict=True)
    assert admin["spec"]["clusterIP"] == "None"
    assert [p["targetPort"] for p in admin["spec"]["ports"]] == ["admin"]
    pod_labels = epp["spec"]["template"]["metadata"]["labels"]
    assert admin["spec"]["selector"].items() <= pod_labels.items()
    monitor = _one(docs, "ServiceMonitor", "epp")
    assert _selects(monitor["spec"]["selector"], admin["metadata"]["labels"])
    assert not _selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["admin"]
    assert "authorization" not in monitor["spec"]["endpoints"][0]  # no worker token to the EPP

    # One policy on the EPP pods, and on nothing else.
    (policy,) = _policies_on(docs, epp)
    assert policy is _policy(docs, "epp")
    kubernetes_validate.validate(policy, kubernetes_validate.latest_version(), strict=True)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for other in (_one(docs, "Deployment", "gateway"), _one(docs, "StatefulSet", "worker")):
        assert policy not in _policies_on(docs, other)
    assert _admitted(policy, ports["grpc"]) == ANYONE  # the Gateway's proxy, wherever it runs
    assert _admitted(policy, ports["http"]) == ANYONE
    assert _admitted(policy, ports["admin"]) == [DEFAULT_SCRAPER]
    # The gateways keep theirs; the probes use the gRPC port, open to all.
    assert _admitted(_policy(docs, "gateway"), _gateway_ports(docs)["admin"]) == [DEFAULT_SCRAPER]
    assert c["readinessProbe"]["grpc"]["port"] == ports["grpc"]["containerPort"]
    assert c["livenessProbe"]["tcpSocket"]["port"] == "grpc"

    # The same extra peers as the gateways' admin port, and none when neither is set.
    extra = [{"ipBlock": {"cidr": "10.20.0.0/16"}}]
    values = {
        "epp": {"enabled": True},
        "networkPolicy": {"metricsScraper": {"enabled": False}, "gatewayAdminExtraFrom": extra},
    }
    docs = _render(values)
    policy = _policy(docs, "epp")
    kubernetes_validate.validate(policy, kubernetes_validate.latest_version(), strict=True)
    assert _admitted(policy, _epp_ports(docs)["admin"]) == extra
    values = {"epp": {"enabled": True}, "networkPolicy": {"metricsScraper": {"enabled": False}}}
    docs = _render(values)
    ports = _epp_ports(docs)
    assert _admitted(_policy(docs, "epp"), ports["admin"]) == []
    assert _admitted(_policy(docs, "epp"), ports["grpc"]) == ANYONE


def test_epp_without_admin_port_serves_metrics_on_http_and_has_no_policy() -> None:
    values = {
        "epp": {"enabled": True},
        "gateway": {"adminPort": None},
        "metrics": {"serviceMonitor": {"enabled": True}},
    }
    docs = _render(values)
    epp = _one(docs, "Deployment", "epp")
    c, cfg = _config(epp)
    assert cfg.admin_port is None and not [a for a in c["args"] if "admin" in a]
    assert set(_epp_ports(docs)) == {"grpc", "http", "peers"}
    assert _policies_on(docs, epp) == []
    assert _kind(docs, "NetworkPolicy") == [_policy(docs, "worker")]
    assert not [d for d in _kind(docs, "Service") if "admin" in d["metadata"]["name"]]
    monitor = _one(docs, "ServiceMonitor", "epp")
    assert _selects(monitor["spec"]["selector"], _one(docs, "Service", "epp")["metadata"]["labels"])
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http"]
    # networkPolicy off: no policy on the EPP either, admin port or not.
    docs = _render({"epp": {"enabled": True}, "networkPolicy": {"enabled": False}})
    assert _kind(docs, "NetworkPolicy") == []


def test_worker_auth_values_are_checked() -> None:
    with pytest.raises(helm.HelmValuesError):
        _render({"workerAuth": {"enabled": "yes"}})
    with pytest.raises(helm.HelmValuesError):
        _render({"workerAuth": {"secretKey": ""}})
    with pytest.raises(helm.HelmValuesError):
        _render({"gateway": {"adminPort": 70000}})


def test_epp_mode_lets_the_epp_and_the_proxy_reach_the_workers() -> None:
    """With kvgate as an InferencePool's EPP, the EPP pods poll and subscribe like gateways, and
    the Gateway's proxy forwards requests to the workers itself: both must get through."""
    docs = _render({"epp": {"enabled": True}})
    policy = _policy(docs, "worker")
    kubernetes_validate.validate(policy, kubernetes_validate.latest_version(), strict=True)
    gateway_rule, _, proxy_rule = policy["spec"]["ingress"]
    epp_labels = _one(docs, "Deployment", "epp")["spec"]["template"]["metadata"]["labels"]
    assert any(_selects(peer["podSelector"], epp_labels) for peer in gateway_rule["from"])
    assert {p["port"] for p in gateway_rule["ports"]} == {"http", "kv-events", "kv-replay"}
    (proxy,) = proxy_rule["from"]
    assert proxy["podSelector"] == {
        "matchLabels": {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}
    }
    assert proxy["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "inference"}
    }
    assert [p["port"] for p in proxy_rule["ports"]] == ["http"]  # never the events
    # The EPP holds the worker token, which it sets on the requests the proxy forwards.
    assert _token_env(_one(docs, "Deployment", "epp")) == _token_env(
        _one(docs, "StatefulSet", "worker")
    )
    # Your Gateway's proxies, by your selectors.
    values = {
        "epp": {"enabled": True},
        "networkPolicy": {
            "proxy": {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}
                },
                "podSelector": {"matchLabels": {"gateway.envoyproxy.io/owning-gateway-name": "gw"}},
            }
        },
    }
    policy = _policy(_render(values), "worker")
    (proxy,) = policy["spec"]["ingress"][2]["from"]
    assert proxy["podSelector"] == values["networkPolicy"]["proxy"]["podSelector"]
    assert proxy["namespaceSelector"] == values["networkPolicy"]["proxy"]["namespaceSelector"]
