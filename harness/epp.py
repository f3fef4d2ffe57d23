"""kvgate's endpoint picker as a process, behind a real Envoy: the Gateway API data plane on
127.0.0.1 (`make demo ARGS=--envoy`, bench.epp_overhead).

`EnvoyFront(cluster)` starts `python -m gateway --epp` over the cluster's workers (with the
cluster's policy and worker token) and an Envoy in front of it in the ORIGINAL_DST shape
(harness/envoy.py); clients send requests to `url` as to a Gateway, and read the EPP's
`/metrics` and `/kvgate/index` at `epp_url`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from harness.cluster import Cluster
from harness.envoy import Envoy
from harness.envoy_config import EnvoySpec
from harness.ports import HOST, free_port
from harness.proc import Proc


class EnvoyFront:
    def __init__(self, cluster: Cluster, log_dir: Path, epp_args: Sequence[str] = (),
                 name: str = "epp", epp_env: Mapping[str, str] | None = None,
                 **envoy: object) -> None:  # fmt: skip
        self.cluster, self.log_dir, self.name = cluster, log_dir, name
        self.epp_args, self.envoy_options = list(epp_args), envoy
        self.epp_env = dict(epp_env or {})  # on top of the cluster's (e.g. another PYTHONPATH)
        self.epp: Proc | None = None
        self.envoy: Envoy | None = None
        self.target = ""  # the EPP's gRPC address

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    @property
    def epp_url(self) -> str:
        assert self.epp is not None
        return self.epp.url

    def start(self, timeout: float = 120.0) -> EnvoyFront:
        c = self.cluster
        http, grpc_port = free_port(), free_port()
        self.target = f"{HOST}:{grpc_port}"
        args = ["-m", "gateway", "--workers", ",".join(c.worker_urls), "--host", HOST,
                "--port", str(http), "--epp", "--epp-port", str(grpc_port),
                "--policy", c.spec.policy, *self.epp_args]  # fmt: skip
        token = c.spec.worker_token
        env = {"KVGATE_WORKER_TOKEN": token} if token else {}
        self.epp = Proc(self.name, args, http, self.log_dir / f"{self.name}.log",
                        env={**env, **self.epp_env})  # fmt: skip
        try:
            self.epp.start()
            self.epp.wait_healthy(timeout)
            spec = EnvoySpec(
                epp=f"{HOST}:{grpc_port}",
                workers=c.worker_urls,
                log_dir=self.log_dir,
                **self.envoy_options,
            )  # type: ignore[arg-type]
            self.envoy = Envoy(spec, name=f"envoy-{self.name}").start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        if self.epp is not None:
            self.epp.kill()

    def __enter__(self) -> EnvoyFront:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
