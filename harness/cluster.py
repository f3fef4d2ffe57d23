"""Start and stop a local kvgate cluster: N workers and a gateway as real processes on 127.0.0.1.

Used by `make demo`, the benchmark scripts and the end-to-end tests, so they all run the same
processes a user would (`python -m worker`, `python -m gateway`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from cachekey.worker_auth import WORKER_TOKEN_ENV
from gateway.names import replica_name
from harness import worker_metrics as wm
from harness.lifetime import unwind_on_termination
from harness.ports import HOST, free_port
from harness.proc import Proc
from harness.waits import wait_index_converged


@dataclass(slots=True)
class ClusterSpec:
    workers: int = 2
    engine: str = "torch"
    model: str = "demo"
    served_model_name: str = "demo"
    num_blocks: int | None = None
    policy: str = "cache_aware"
    gateways: int = 1
    # The gateways share placements and in-flight load (--peer-port, --peers: gateway/peers/).
    peers: bool = False
    worker_args: Sequence[str] = ()
    # Extra arguments for worker i only (fault tests give one worker a different setting).
    per_worker_args: Sequence[Sequence[str]] = ()
    gateway_args: Sequence[str] = ()
    # Port of the first gateway if it is free (the demo asks for 8080); otherwise any free port.
    gateway_port: int | None = None
    log_dir: Path = Path("bench/results/logs")
    startup_timeout: float = 120.0
    # The shared worker token (docs/security.md), given to workers and gateways in
    # KVGATE_WORKER_TOKEN; None: workers are open, as `make demo` runs them.
    worker_token: str | None = None
    # The processes get SIGTERM when the process that started them ends, even by SIGKILL
    # (harness/lifetime.py). None: when the cluster is started from the main thread.
    die_with_parent: bool | None = None


class Cluster:
    """A context manager: `with Cluster(spec) as c: c.gateway_url ...`."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.workers: list[Proc] = []
        self.gateways: list[Proc] = []
        self.peer_ports: list[int] = []  # gateway i's --peer-port (spec.peers)
        self._unwinding = contextlib.ExitStack()
        spec.log_dir.mkdir(parents=True, exist_ok=True)

    @property
    def gateway_url(self) -> str:
        return self.gateways[0].url

    @property
    def worker_urls(self) -> list[str]:
        return [w.url for w in self.workers]

    @property
    def _env(self) -> dict[str, str]:
        token = self.spec.worker_token
        return {WORKER_TOKEN_ENV: token} if token else {}

    def replica_name(self, worker_url: str) -> str:
        """The name the gateways give the worker at `worker_url` (their `x-kvgate-replica`)."""
        return replica_name(worker_url, self.spec.worker_token)

    def served_by(self, response: httpx.Response) -> str:
        """The URL of the worker that served a gateway's response (from `x-kvgate-replica`)."""
        names = {self.replica_name(url): url for url in self.worker_urls}
        return names[response.headers["x-kvgate-replica"]]

    def make_worker(self, i: int) -> Proc:
        s = self.spec
        port, ev, rp = free_port(), free_port(), free_port()
        args = [
            "-m",
            "worker",
            "--model",
            s.model,
            "--served-model-name",
            s.served_model_name,
            "--engine",
            s.engine,
            "--host",
            HOST,
            "--port",
            str(port),
            "--kv-events-port",
            str(ev),
            "--kv-events-replay-port",
            str(rp),
        ]
        if s.num_blocks is not None:
            args += ["--num-blocks", str(s.num_blocks)]
        args += list(s.worker_args)
        if i < len(s.per_worker_args):
            args += list(s.per_worker_args[i])
        log = s.log_dir / f"worker-{i}.log"
        log.write_bytes(b"")
        extra = {"events": ev, "replay": rp}
        return Proc(
            f"worker-{i}",
            args,
            port,
            log,
            extra=extra,
            env=self._env,
            die_with_parent=s.die_with_parent,
        )

    def workers_arg(self) -> str:
        """The gateways' --workers value (kvgate workers say the rest in /kvgate/info)."""
        return ",".join(self.worker_urls)

    def reset_prefix_caches(self) -> None:
        """Empty every worker's prefix cache (each publishes AllBlocksCleared)."""
        wm.reset_prefix_caches(self.worker_urls)

    def settle_index(self, router_url: str | None = None) -> None:
        """Until the index of `router_url` (default: the first gateway) equals every worker's
        cache (their snapshots)."""
        wait_index_converged(router_url or self.gateway_url, self.worker_urls)

    def make_gateway(self, i: int) -> Proc:
        s = self.spec
        port = free_port(s.gateway_port if i == 0 else None)
        args = [
            "-m",
            "gateway",
            "--workers",
            self.workers_arg(),
            "--host",
            HOST,
            "--port",
            str(port),
            "--policy",
            s.policy,
            *self.peer_args(i),
            *s.gateway_args,
        ]
        log = s.log_dir / f"gateway-{i}.log"
        log.write_bytes(b"")
        return Proc(
            f"gateway-{i}", args, port, log, env=self._env, die_with_parent=s.die_with_parent
        )

    def peer_args(self, i: int) -> list[str]:
        """Gateway i's peer flags: its own port, and every gateway's in --peers."""
        if not self.spec.peers:
            return []
        if not self.peer_ports:
            self.peer_ports = [free_port() for _ in range(self.spec.gateways)]
        peers = ",".join(f"{HOST}:{p}" for p in self.peer_ports)
        return ["--peer-port", str(self.peer_ports[i]), "--peers", peers]

    def start(self) -> Cluster:
        try:
            self.workers = [self.make_worker(i) for i in range(self.spec.workers)]
            for w in self.workers:
                w.start()
            for w in self.workers:
                w.wait_healthy(self.spec.startup_timeout)
            self.gateways = [self.make_gateway(i) for i in range(self.spec.gateways)]
            for g in self.gateways:
                g.start()
            for g in self.gateways:
                g.wait_healthy(self.spec.startup_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def restart_worker(self, i: int) -> None:
        """Stop worker i (if alive) and start it again on the same ports: a new instance id."""
        w = self.workers[i]
        w.kill()
        w.start()
        w.wait_healthy(self.spec.startup_timeout)

    def stop(self) -> None:
        for p in [*self.gateways, *self.workers]:
            p.kill()

    def __enter__(self) -> Cluster:
        """Start it; a SIGTERM or SIGHUP now unwinds to `__exit__` (harness/lifetime.py)."""
        self._unwinding.enter_context(unwind_on_termination())
        try:
            return self.start()
        except BaseException:
            self._unwinding.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self._unwinding.close()  # a second signal while stopping ends this process at once
        self.stop()
