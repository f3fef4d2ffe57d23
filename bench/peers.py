"""kvgate side by side with SGLang's router and vllm-router, over the same sim workers, in one run.

1. Hit rate: the shared-prefix workload of `bench.hit_rate` (4 replicas by default) through each
   router and policy; every worker's prefix cache is reset between runs. Hit rate and requests per
   replica come from the workers' own counters, since the peers send no kvgate headers.
2. Overhead: p50 latency of sequential short requests and the throughput ceiling at many
   concurrent clients through each router (cache_aware), against the workers directly, on zero
   compute-time workers.

The peers are third-party Rust binaries from PyPI; they are not kvgate dependencies:

    .venv/bin/pip install sglang-router vllm-router  # or: python -m bench.peers --install
    python -m bench.peers                            # table + bench/results/peers.json
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.lib.closed_loop import ZERO_COMPUTE, Load, measure, print_loads
from bench.lib.report import args_dict, col, columns, print_table, write_json
from bench.lib.runs import POLICY_HEADER, drive, reset_caches
from harness import worker_metrics as wm
from harness.cluster import Cluster, ClusterSpec
from harness.driver import hit_rate
from harness.ports import HOST, free_port
from harness.proc import Proc
from harness.workload import Workload, WorkloadSpec

PEERS = {"sglang-router": "sglang-router", "vllm-router": "vllm-router"}


@dataclass(slots=True)
class Router:
    """One router in front of the workers: kvgate's gateway, or a peer binary."""

    name: str
    policy: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class HitRow:
    router: str = col("router", 15, left=True)
    policy: str = col("policy", 13, left=True)
    requests: int = col("reqs", 5)
    failed: int = col("fail", 5)
    hit_rate: float = col("hit", 8, ".1%")
    worker_hit_rate: float = col("worker hit", 11, ".1%")
    max_over_mean: float = col("max/mean", 9, ".2f")
    requests_per_replica: list[int]


HIT_COLUMNS = columns(HitRow)


def peer_binary(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def install_peers() -> None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", *PEERS.values()])


def start_peer(name: str, policy: str, workers: list[str], log_dir: Path) -> Proc:
    binary = peer_binary(name)
    if binary is None:
        raise FileNotFoundError(name)
    port, prom = free_port(), free_port()
    args = ["--host", HOST, "--port", str(port), "--worker-urls", *workers, "--policy", policy]
    args += ["--prometheus-host", HOST, "--prometheus-port", str(prom)]
    if name == "sglang-router":
        args = ["launch", *args]
    log = log_dir / f"{name}-{policy}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"")
    # Proc runs `sys.executable ARGS`; a peer is its own executable, so exec it from a shim.
    shim = ["-c", "import os,sys; os.execv(sys.argv[1], sys.argv[1:])", binary, *args]
    proc = Proc(f"{name}-{policy}", shim, port, log)
    proc.start()
    wait_routing(proc)
    return proc


def wait_routing(proc: Proc, timeout: float = 60.0) -> None:
    """A router is ready when it answers a chat request (its /health may not check the workers)."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.log_tail()}")
        try:
            if httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=5).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{proc.name} not routing after {timeout:.0f}s:\n{proc.log_tail()}")


def hit_row(router: Router, workers: list[str], workload: Workload, conc: int) -> HitRow:
    reset_caches(workers)
    m = drive(router.url, workers, workload, concurrency=conc, headers=router.headers)
    counts = [round(c.requests) for c in m.per_worker.values()]
    return HitRow(
        router=router.name,
        policy=router.policy,
        requests=len(m.results),
        failed=sum(not r.ok for r in m.results),
        hit_rate=hit_rate(m.results),
        worker_hit_rate=wm.hit_rate(m.per_worker),
        max_over_mean=round(wm.max_over_mean(counts), 2),
        requests_per_replica=counts,
    )


def hit_rate_part(args: argparse.Namespace, peers: list[str], notes: dict) -> list[HitRow]:
    n = args.replicas
    workload = Workload(
        WorkloadSpec(tenants=3 * n, users_per_tenant=3, turns=3, system_words=1200, seed=args.seed)
    )
    spec = ClusterSpec(
        workers=n,
        engine="sim",
        num_blocks=args.num_blocks,
        gateway_args=("--poll-interval", "0.2"),
        log_dir=args.log_dir / "hit_rate",
    )
    rows: list[HitRow] = []
    with Cluster(spec) as c:
        for policy in ("cache_aware", "round_robin"):
            router = Router("kvgate", policy, c.gateway_url, {POLICY_HEADER: policy})
            rows.append(hit_row(router, c.worker_urls, workload, args.concurrency))
            print_table(rows[-1:], HIT_COLUMNS, header=len(rows) == 1)
        for name in peers:
            for policy in ("cache_aware", "round_robin"):
                try:
                    proc = start_peer(name, policy, c.worker_urls, args.log_dir)
                except (OSError, RuntimeError, TimeoutError) as e:
                    notes[f"{name} {policy}"] = f"could not start: {e}"
                    print(f"{name} {policy}: could not start: {e}")
                    continue
                try:
                    router = Router(name, policy, proc.url)
                    rows.append(hit_row(router, c.worker_urls, workload, args.concurrency))
                    print_table(rows[-1:], HIT_COLUMNS, header=False)
                finally:
                    proc.kill()
    return rows


def overhead_part(args: argparse.Namespace, peers: list[str], notes: dict) -> list[Load]:
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        worker_args=ZERO_COMPUTE,
        gateway_args=("--poll-interval", "0.5"),
        log_dir=args.log_dir / "overhead",
    )
    rows: list[Load] = []
    with Cluster(spec) as c:
        targets = [("direct", c.worker_urls, None), ("kvgate", [c.gateway_url], None)]
        targets += [(name, None, name) for name in peers]
        for label, urls, peer in targets:
            proc = None
            if peer is not None:
                try:
                    proc = start_peer(peer, "cache_aware", c.worker_urls, args.log_dir / "overhead")
                except (OSError, RuntimeError, TimeoutError) as e:
                    notes[f"{peer} overhead"] = f"could not start: {e}"
                    continue
                urls = [proc.url]
            try:
                for conc in (1, args.clients):
                    n = args.requests // 4 if conc == 1 else args.requests
                    rows.append(measure(label, urls, n, conc))
                    print_loads(rows[-1:], header=len(rows) == 1)
            finally:
                if proc is not None:
                    proc.kill()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--install", action="store_true", help="pip install the peer routers first")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=860)
    ap.add_argument("--concurrency", type=int, default=4, help="clients of the hit-rate workload")
    ap.add_argument("--clients", type=int, default=64, help="clients of the throughput ceiling")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/logs/peers"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/peers.json"))
    args = ap.parse_args()
    if args.install:
        install_peers()
    notes: dict[str, str] = {}
    peers = []
    for name in (p for p in args.peers.split(",") if p):
        if name not in PEERS:
            ap.error(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
        if peer_binary(name) is None:
            notes[name] = f"not installed: run `{sys.executable} -m pip install {PEERS[name]}`"
            print(f"skipping {name}: {notes[name]}")
        else:
            peers.append(name)
    hits = hit_rate_part(args, peers, notes)
    loads = [] if args.skip_overhead else overhead_part(args, peers, notes)
    summary = {
        "args": args_dict(args),
        "hit_rate": [asdict(r) for r in hits],
        "overhead": [asdict(r) for r in loads],
        "notes": notes,
    }
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
