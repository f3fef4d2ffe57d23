"""The chart's security values reach the gateway: its rendered args parse into the config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import build_parser, config_from_args

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")

CHART = Path(__file__).resolve().parent.parent / "helm" / "kvgate"


def _gateway(values: dict[str, Any] | None) -> dict[str, Any]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name="kvgate", namespace="inference", is_install=True)
    for template, text in out.items():
        if template.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc and doc["kind"] == "Deployment" and "gateway" in doc["metadata"]["name"]:
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


def test_auth_secret_limits_and_fetch_values() -> None:
    values = {
        "auth": {"existingSecret": "api-keys", "secretKey": "keys.yaml", "saltSecretKey": "salt"},
        "gateway": {
            "limits": {"maxPromptTokens": 4096, "maxN": 4},
            "imageFetch": {"remoteImages": False, "allow": ["images.internal", "10.1.0.0/16"]},
            "overload": {"maxInflightPerReplica": 0, "maxQueue": 10, "queueTimeoutSeconds": 2},
        },
    }
    dep = _gateway(values)
    c, cfg = _config(dep)
    assert cfg.api_keys_file == "/etc/kvgate/auth/keys.yaml"
    assert cfg.limits.max_prompt_tokens == 4096 and cfg.limits.max_n == 4
    assert not cfg.remote_images
    assert cfg.image_fetch_allow == ("images.internal", "10.1.0.0/16")
    assert cfg.max_inflight_per_replica is None and cfg.max_queue == 10
    (salt,) = [e for e in c["env"] if e["name"] == "KVGATE_TENANT_SALT_SECRET"]
    assert salt["valueFrom"]["secretKeyRef"] == {"name": "api-keys", "key": "salt"}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "api-keys")
    assert mount["mountPath"] == "/etc/kvgate/auth" and "subPath" not in mount
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys")
    assert vol["secret"]["secretName"] == "api-keys"
