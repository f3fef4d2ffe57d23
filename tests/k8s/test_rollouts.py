"""The chart's rollouts: grace periods and preStop hooks that match the gateway's and the
workers' drains, and a PodDisruptionBudget for each Deployment that has pods, rendered by Helm's
engine and validated against the Kubernetes schemas."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.cli import build_parser, config_from_args
from kvgate_cli.flags import config_from_flags
from tests.support.paths import CHART
from worker.cli import build_parser as worker_parser
from worker.server.config import ServerConfig

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")

K8S_VERSION = kubernetes_validate.latest_version()
EPP_ONLY = {"gateway": {"replicas": 0}, "epp": {"enabled": True}}


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(CHART) as c:
        yield c


def render(chart: Any, values: dict[str, Any] | None) -> list[dict[str, Any]]:
    out = chart.render(values, name="kvgate", namespace="inference", is_install=True)
    docs = [
        d
        for template, text in out.items()
        if not template.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
        if d
    ]
    for d in docs:
        if d["apiVersion"].startswith(("apps/", "policy/")):
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    return docs


def deployments(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for d in docs
        if d["kind"] == "Deployment"
    }


def drain_of(dep: dict[str, Any]) -> tuple[int, int, float]:
    """(grace period, preStop sleep, the process's drain timeout) of a gateway Deployment."""
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    hook = c.get("lifecycle", {}).get("preStop")
    sleep = 0
    if hook is not None:
        cmd = hook["exec"]["command"]
        assert cmd[0] == "sleep"
        sleep = int(cmd[1])
    argv = [a.replace("$(POD_NAMESPACE)", "inference") for a in c["args"]]
    config = config_from_args(build_parser().parse_args(argv))
    return pod["terminationGracePeriodSeconds"], sleep, config.drain_timeout


@pytest.mark.parametrize(
    "values, want",
    [
        (None, (40, 5, 30)),
        ({"gateway": {"drainTimeoutSeconds": 600, "preStopSleepSeconds": 10}}, (615, 10, 600)),
        ({"gateway": {"preStopSleepSeconds": 0}}, (35, 0, 30)),
    ],
)
def test_grace_period_covers_prestop_and_drain(chart: Any, values: Any, want: tuple) -> None:
    docs = render(chart, values)
    grace, sleep, drain = drain_of(deployments(docs)["gateway"])
    assert (grace, sleep, drain) == want
    # The kubelet's SIGKILL comes after the preStop sleep and the whole drain, not during it.
    assert grace >= sleep + drain + 5


def test_epp_drains_like_the_gateway(chart: Any) -> None:
    values = {"epp": {"enabled": True}, "gateway": {"drainTimeoutSeconds": 120}}
    deps = deployments(render(chart, values))
    assert drain_of(deps["epp"]) == drain_of(deps["gateway"]) == (130, 5, 120)


def pdbs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodDisruptionBudget"}


def pods_selected(docs: list[dict[str, Any]], pdb: dict[str, Any]) -> int:
    """Replicas of the workloads whose pod labels the PDB's selector matches."""
    want = pdb["spec"]["selector"]["matchLabels"].items()
    return sum(
        d["spec"]["replicas"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        and want <= d["spec"]["template"]["metadata"]["labels"].items()
    )


@pytest.mark.parametrize(
    "values, names",
    [
        (None, {"kvgate-gateway", "kvgate-worker"}),
        ({"epp": {"enabled": True}}, {"kvgate-gateway", "kvgate-epp", "kvgate-worker"}),
        (EPP_ONLY, {"kvgate-epp", "kvgate-worker"}),
        ({**EPP_ONLY, "epp": {"enabled": True, "pdb": {"enabled": False}}}, {"kvgate-worker"}),
    ],
)
def test_a_pdb_for_each_deployed_component(chart: Any, values: Any, names: set[str]) -> None:
    docs = render(chart, values)
    found = pdbs(docs)
    assert set(found) == names
    for pdb in found.values():  # none guards an empty set of pods
        assert pods_selected(docs, pdb) > pdb["spec"].get("minAvailable", 0)


def test_schema_rejects_bad_rollout_values(chart: Any) -> None:
    for bad in (
        {"gateway": {"drainTimeoutSeconds": -1}},
        {"gateway": {"preStopSleepSeconds": "5s"}},
        {"epp": {"pdb": {"minAvailabel": 1}}},
    ):
        with pytest.raises(helm.HelmValuesError):
            chart.render(bad, name="kvgate", namespace="inference", is_install=True)


def worker_drain_of(docs: list[dict[str, Any]]) -> tuple[int, int, float]:
    """(grace period, preStop sleep, --drain-timeout) of the worker StatefulSet."""
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    hook = c.get("lifecycle", {}).get("preStop")
    sleep = int(hook["exec"]["command"][1]) if hook is not None else 0
    argv = [a.replace("$(POD_NAMESPACE)", "inference") for a in c["args"]]
    config = config_from_flags(ServerConfig, worker_parser().parse_args(argv))
    return pod["terminationGracePeriodSeconds"], sleep, config.drain_timeout


@pytest.mark.parametrize(
    "values, want",
    [
        (None, (130, 5, 120)),
        ({"worker": {"drainTimeoutSeconds": 900, "preStopSleepSeconds": 10}}, (915, 10, 900)),
        ({"worker": {"preStopSleepSeconds": 0}}, (125, 0, 120)),
        ({"worker": {"terminationGracePeriodSeconds": 3600}}, (3600, 5, 120)),
    ],
)
def test_worker_grace_period_covers_prestop_and_drain(chart: Any, values: Any, want: tuple) -> None:
    grace, sleep, drain = worker_drain_of(render(chart, {"model": {"demo": True}} | (values or {})))
    assert (grace, sleep, drain) == want
    assert grace >= sleep + drain + 5


def test_a_worker_grace_period_shorter_than_its_drain_is_refused(chart: Any) -> None:
    values = {"model": {"demo": True}, "worker": {"terminationGracePeriodSeconds": 60}}
    with pytest.raises(Exception, match="must cover"):
        chart.render(values, name="kvgate", namespace="inference", is_install=True)
