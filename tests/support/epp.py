"""An endpoint picker (`python -m gateway --epp`) over a cluster's workers, for the Envoy tests:
started with the worker token and polled until every worker is synced."""

from __future__ import annotations

from harness.cluster import Cluster
from harness.ports import HOST, free_port
from harness.proc import Proc
from tests.support.waits import wait_synced

TOKEN = "envoy-" + "5eed" * 8


def start_epp(c: Cluster, log_dir, name: str, *extra: str) -> tuple[Proc, str]:
    http, grpc_port = free_port(), free_port()
    args = ["-m", "gateway", "--workers", ",".join(c.worker_urls), "--host", HOST,
            "--port", str(http), "--epp", "--epp-port", str(grpc_port),
            "--poll-interval", "0.2", "--recent-weight", "0", *extra]  # fmt: skip
    proc = Proc(name, args, http, log_dir / f"{name}.log", env={"KVGATE_WORKER_TOKEN": TOKEN})
    proc.start()
    proc.wait_healthy(60)
    try:  # every worker polled and its events subscribed: the picks are the index's
        wait_synced(proc.url, len(c.worker_urls))
    except AssertionError as e:
        raise AssertionError(f"{e}\n{proc.log_tail()}") from None
    return proc, f"{HOST}:{grpc_port}"


def ep(url: str) -> str:
    return url.removeprefix("http://")
