"""Does `--max-inflight-per-replica` hold across peer gateways? The workers' own counts say.

N gateways with peers in front of sim workers; closed-loop clients, the same number on every
gateway, send slow requests (distinct prompts, so the cap, not the cache, decides where each
goes). A sampler (harness/worker_load.py) reads what each worker holds every few ms: running
plus waiting, never more than the slots the gateways hold on it.

    .venv/bin/python -m bench.peer_cap                      # 4 gateways, cap 4, both modes
    .venv/bin/python -m bench.peer_cap --admission shares --seconds 10

Per mode and round: the peak per replica over the cap, the share of samples over it, and the
requests served, refused and failed. Modes alternate, rotating which runs first each round.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from harness.cluster import Cluster, ClusterSpec
from harness.worker_load import LoadSampler

RESULTS = Path("bench/results/peer_cap.json")
OUTCOME = {200: "ok", 429: "refused"}


def client_loop(gw: str, ident: str, until: float, max_tokens: int, tally: dict) -> None:
    body = {"model": "demo", "max_tokens": max_tokens, "ignore_eos": True}
    with httpx.Client(timeout=120) as client:
        i = 0
        while time.monotonic() < until:
            i += 1
            msgs = [{"role": "user", "content": f"client {ident} request {i}: hold a slot"}]
            try:
                r = client.post(f"{gw}/v1/chat/completions", json={**body, "messages": msgs})
                key = OUTCOME.get(r.status_code, "failed")
            except httpx.HTTPError:
                key = "failed"
            with tally["lock"]:
                tally[key] += 1


def run_mode(c: Cluster, args: argparse.Namespace) -> dict:
    tally: dict = {"ok": 0, "refused": 0, "failed": 0, "lock": threading.Lock()}
    until = time.monotonic() + args.seconds
    n = args.clients_per_gateway
    sampler = LoadSampler(c.worker_urls, c.spec.worker_token, args.sample_every)
    with sampler, ThreadPoolExecutor(len(c.gateways) * n) as pool:
        for g, gw in enumerate(c.gateways):
            for k in range(n):
                ident = f"{g}-{k}-{time.time()}"
                pool.submit(client_loop, gw.url, ident, until, args.max_tokens, tally)
    over = [x for x in sampler.counts if x > args.cap]
    return {
        "peak": sampler.peak,
        "peak_over_cap": sampler.peak / args.cap,
        "samples_over_cap": len(over) / max(len(sampler.counts), 1),
        "samples": len(sampler.counts),
        "ok": tally["ok"],
        "refused": tally["refused"],
        "failed": tally["failed"],
    }


def cluster_for(mode: str, args: argparse.Namespace, log_dir: Path) -> Cluster:
    gateway_args = ["--max-inflight-per-replica", str(args.cap), "--max-queue", "10000"]
    gateway_args += ["--queue-timeout", "60", "--peer-admission", mode]
    spec = ClusterSpec(
        workers=args.workers,
        gateways=args.gateways,
        peers=True,
        engine="sim",
        worker_token="peer-cap-bench-token-0123456789",
        worker_args=("--sim-decode-s-per-step", str(args.decode_s)),
        gateway_args=tuple(gateway_args),
        log_dir=log_dir,
        startup_timeout=180,
    )
    return Cluster(spec)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gateways", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cap", type=int, default=4, help="--max-inflight-per-replica")
    p.add_argument("--clients-per-gateway", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--decode-s", type=float, default=0.05, help="sim seconds per decode step")
    p.add_argument("--seconds", type=float, default=15.0, help="per mode and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sample-every", type=float, default=0.005)
    p.add_argument("--admission", default="counted,shares", help="--peer-admission modes")
    return p


def main() -> None:
    args = parser().parse_args()
    modes = [m.strip() for m in args.admission.split(",") if m.strip()]
    log_dir = Path("bench/results/logs/peer_cap")
    rows = []
    clusters = {m: cluster_for(m, args, log_dir / m) for m in modes}
    try:
        for c in clusters.values():
            c.start()
        for c in clusters.values():  # warm: every gateway renders and routes once
            for gw in c.gateways:
                httpx.post(f"{gw.url}/v1/chat/completions", timeout=60, json={
                    "model": "demo", "max_tokens": 1,
                    "messages": [{"role": "user", "content": "warm"}]})  # fmt: skip
        for r in range(args.rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for m in order:
                row = {"round": r + 1, "mode": m, **run_mode(clusters[m], args)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for c in clusters.values():
            c.stop()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
