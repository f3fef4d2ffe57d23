"""One replica name everywhere, stable across a pod's restart (issue 39).

A real gateway discovers a real sim worker through a Kubernetes API (tests/support/k8s_fake_api.py)
as the chart runs it: an EndpointSlice whose endpoint names its pod, `kvgate-worker-0`. The pod
restarts as a StatefulSet pod does: same name, a new address (here a new port, so a new URL).
Clients (`x-kvgate-replica`), 503 messages and every `replica` label name it `kvgate-worker-0`
before and after, so each per-replica panel of the Grafana dashboard keeps one series; the URL
is one label of `kvgate_replica_info`, for joins.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.cluster import Cluster, ClusterSpec
from harness.waits import wait_until
from tests.support.chat import chat, user
from tests.support.k8s_fake_api import FakeApi, FakeApiServer, make_slice
from tests.support.paths import CHART

pytestmark = pytest.mark.slow

POD = "kvgate-worker-0"
DASHBOARD = CHART / "dashboards" / "kvgate.json"
METRIC = re.compile(r"\bkvgate_[a-z0-9_]+")


def per_replica_metrics() -> set[str]:
    """The gateway metrics the dashboard's per-replica panels group `by (replica)`."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    return {m for e in exprs if "by (replica" in e for m in METRIC.findall(e)}


def series(gateway_url: str, names: set[str]) -> dict[str, set[tuple[str, str]]]:
    """Per metric, its (replica, url) label pairs on the gateway's /metrics."""
    out: dict[str, set[tuple[str, str]]] = {}
    wanted = {n.removesuffix("_total") for n in names}
    text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            replica = s.labels.get("replica", "none")
            if s.name.removesuffix("_total") in wanted and replica != "none":
                out.setdefault(s.name, set()).add((replica, s.labels.get("url", "")))
    return out


def test_a_restarted_pod_keeps_its_name_and_its_series(tmp_path, monkeypatch) -> None:
    spec = ClusterSpec(
        workers=1,
        engine="sim",
        num_blocks=256,
        gateways=0,
        gateway_args=("--discovery", "k8s", "--k8s-namespace", "ns", "--k8s-service", "workers",
                      "--poll-interval", "0.2"),
        log_dir=tmp_path,
        startup_timeout=60,
    )  # fmt: skip
    api = FakeApi()
    with Cluster(spec) as c, FakeApiServer(api) as server:
        (w,) = c.workers
        api.put(make_slice("workers-0", [("127.0.0.1", True)], http_port=w.port, pods=[POD]))
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(server.kubeconfig())
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        g = c.make_gateway(0)
        c.gateways = [g]
        g.start()
        g.wait_healthy(60)
        first_url = w.url
        before = [chat(g.url, user(f"before the restart {i}")) for i in range(3)]

        # The pod restarts: gone from the slice, then back under its name at a new address.
        w.kill()
        api.put(make_slice("workers-0", [], http_port=w.port))
        down = chat(g.url, user("while it is away"))
        new = c.make_worker(0)  # new ports: a new URL, as a new pod IP gives one
        c.workers = [new]
        new.start()
        new.wait_healthy(60)
        api.put(make_slice("workers-0", [("127.0.0.1", True)], http_port=new.port, pods=[POD]))
        wait_until(lambda: chat(g.url, user("probe")).status_code == 200, 30, "the new pod")
        after = [chat(g.url, user(f"after the restart {i}")) for i in range(3)]
        seen = series(g.url, per_replica_metrics() | {"kvgate_replica_info"})

    assert [r.headers["x-kvgate-replica"] for r in before + after] == [POD] * 6
    assert down.status_code == 503 and first_url not in down.text
    print(f"per-replica series after the restart: {seen}")
    assert new.url != first_url
    assert set(seen) >= {"kvgate_requests_total", "kvgate_replica_healthy", "kvgate_replica_info"}
    for name, labels in seen.items():
        if name == "kvgate_replica_info":
            assert labels == {(POD, new.url)}, labels  # the URL, one label, for joins
        else:
            assert {replica for replica, _ in labels} == {POD}, (name, labels)
