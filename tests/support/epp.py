"""An endpoint picker (`python -m gateway --epp`) over a cluster's workers, for the Envoy tests:
started with the worker token and polled until every worker is synced."""

from __future__ import annotations

import time

import httpx

from harness.cluster import HOST, Cluster, Proc, free_port

TOKEN = "envoy-" + "5eed" * 8


def start_epp(c: Cluster, log_dir, name: str, *extra: str) -> tuple[Proc, str]:
    http, grpc_port = free_port(), free_port()
    args = ["-m", "gateway", "--workers", ",".join(c.worker_urls), "--host", HOST,
            "--port", str(http), "--epp", "--epp-port", str(grpc_port),
            "--poll-interval", "0.2", "--recent-weight", "0", *extra]  # fmt: skip
    proc = Proc(name, args, http, log_dir / f"{name}.log", env={"KVGATE_WORKER_TOKEN": TOKEN})
    proc.start()
    proc.wait_healthy(60)
    deadline = time.monotonic() + 20
    while True:  # every worker polled and its events subscribed: the picks are the index's
        reps = httpx.get(f"{proc.url}/kvgate/index", timeout=5).json()["replicas"].values()
        if len(reps) == len(c.worker_urls) and all(r["synced"] and r["healthy"] for r in reps):
            return proc, f"{HOST}:{grpc_port}"
        assert time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.1)


def ep(url: str) -> str:
    return url.removeprefix("http://")
