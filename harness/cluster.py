"""Start and stop a local kvgate cluster: N workers and a gateway as real processes on 127.0.0.1.

Used by `make demo`, the benchmark scripts and the end-to-end tests, so they all run the same
processes a user would (`python -m worker`, `python -m gateway`).
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cachekey.documents import Snapshot, decode_document
from cachekey.worker_auth import WORKER_TOKEN_ENV
from gateway.fleet.names import replica_name
from harness import worker_metrics as wm
from harness.lifetime import die_with_parent

HOST = "127.0.0.1"


def _handout_range() -> range:
    """Ports below the kernel's ephemeral range (where outgoing connections take theirs)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - 12000), max(2048, low))


_RANGE = _handout_range()
_next_port = random.Random().randrange(len(_RANGE))
_handed: set[int] = set()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def free_port(preferred: int | None = None) -> int:
    """`preferred` when it is free on HOST, otherwise a free port nobody else was handed.

    The port is for another process to bind later. A port the kernel picks (bind to 0) can be
    taken in the meantime by any outgoing connection, which draws from the same ephemeral range;
    so ports come from just below that range, each handed out once per process, from a random
    start that keeps concurrent test runs apart.
    """
    global _next_port
    if preferred and _bindable(preferred):
        return preferred
    for _ in range(len(_RANGE)):
        port = _RANGE[_next_port % len(_RANGE)]
        _next_port += 1
        if port not in _handed and _bindable(port):
            _handed.add(port)
            return port
    raise OSError("no free port")


def free_port_run(n: int) -> int:
    """A port p such that p .. p + n - 1 are all free (a base port and its ranks' offsets)."""
    while True:
        run = [free_port()]
        while len(run) < n and (q := free_port()) == run[-1] + 1:
            run.append(q)
        if len(run) == n:
            return run[0]


@dataclass(slots=True)
class Proc:
    name: str
    args: list[str]
    port: int
    log_path: Path
    popen: subprocess.Popen | None = None
    extra: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    # SIGTERM when this process ends, even by SIGKILL (harness/lifetime.py: main thread only).
    die_with_parent: bool = False
    executable: str | None = None  # the interpreter (None: this one); vLLM has a venv of its own

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.alive() and self.popen is not None else None

    def start(self) -> None:
        log = self.log_path.open("ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        # A new session, so stopping the cluster also stops anything the process started.
        self.popen = subprocess.Popen(
            [self.executable or sys.executable, *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent() if self.die_with_parent else None,
        )
        log.close()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def kill(self, sig: int = signal.SIGTERM, wait: float = 10.0) -> None:
        if not self.alive():
            return
        assert self.popen is not None
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(wait)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)


@dataclass(slots=True)
class ClusterSpec:
    workers: int = 2
    engine: str = "torch"
    model: str = "demo"
    served_model_name: str = "demo"
    num_blocks: int | None = None
    policy: str = "cache_aware"
    gateways: int = 1
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
    # (`make demo`); start the cluster from the main thread then (harness/lifetime.py).
    die_with_parent: bool = False


class Cluster:
    """A context manager: `with Cluster(spec) as c: c.gateway_url ...`."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.workers: list[Proc] = []
        self.gateways: list[Proc] = []
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
            *s.gateway_args,
        ]
        log = s.log_dir / f"gateway-{i}.log"
        log.write_bytes(b"")
        return Proc(
            f"gateway-{i}", args, port, log, env=self._env, die_with_parent=s.die_with_parent
        )

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
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- observing a running cluster (soak, fault tests) --------------------------------------------


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a live process from /proc (Linux), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    return None


def snapshot_digest(
    worker_url: str, headers: dict[str, str] | None = None, client: httpx.Client | None = None
) -> tuple[str, int]:
    """(digest, blocks) of a worker's `/kv/snapshot`, computed like the gateway's index digest.

    kvgate workers key blocks exactly as the gateway does, so equal digests mean the gateway's
    index holds exactly the worker's cached blocks. A replica id `URL#dp<r>` (data-parallel rank
    r of a worker) names that rank's snapshot.
    """
    url, _, rank = worker_url.partition("#dp")
    query = f"?rank={rank}" if rank else ""
    resp = (client or httpx).get(f"{url}/kv/snapshot{query}", headers=headers, timeout=10)
    snap = decode_document(resp.content, Snapshot)
    keys = sorted({bytes.fromhex(b.key) for b in snap.blocks})
    h = hashlib.sha256()
    for key in keys:
        h.update(key)
    return h.hexdigest(), len(keys)


def index_mismatches(
    gateway_url: str,
    worker_urls: Sequence[str],
    headers: dict[str, str] | None = None,
    client: httpx.Client | None = None,
) -> dict[str, str]:
    """Workers whose gateway index entry differs from their snapshot (empty: converged).
    `client` keeps its connections between calls (httpx.get makes a new client each time)."""
    http = client or httpx
    replicas = http.get(f"{gateway_url}/kvgate/index", timeout=10).json()["replicas"]
    bad: dict[str, str] = {}
    for url in worker_urls:
        digest, blocks = snapshot_digest(url, headers, client)
        entry = replicas.get(url)
        if entry is None:
            bad[url] = "not in the gateway's index"
        elif entry["digest"] != digest or entry["blocks"] != blocks:
            bad[url] = f"gateway {entry['blocks']} blocks vs worker {blocks}"
    return bad


def wait_index_converged(
    gateway_url: str,
    worker_urls: Sequence[str],
    timeout: float = 15.0,
    headers: dict[str, str] | None = None,
) -> None:
    """Poll until the gateway's index equals every worker's snapshot; raise with the diff.
    `headers`: for workers that want their token."""
    deadline = time.monotonic() + timeout
    while True:
        bad = index_mismatches(gateway_url, worker_urls, headers)
        if not bad:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"gateway index did not converge: {bad}")
        time.sleep(0.2)


def metric_total(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    """Sum of every sample of one Prometheus metric at `url`/metrics (0 when absent);
    `headers` for a worker that wants its token."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", headers=headers, timeout=10).text.splitlines():
        if line.split("{")[0].split(" ")[0] == name:
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric_by_labels(url: str, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """One metric's samples at `url`/metrics keyed by the values of `labels` (summed over the
    rest), e.g. `metric_by_labels(gw, "kvgate_requests_total", "replica", "status")`."""
    out: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name:
                key = tuple(s.labels.get(label, "") for label in labels)
                out[key] = out.get(key, 0.0) + s.value
    return out


def wait_until(cond: Callable[[], bool], timeout: float, what: str = "condition") -> float:
    """Poll `cond` every 0.1 s; returns the seconds it took, raises AssertionError on timeout."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - start
