"""Soak: a bounded-in-time run through the gateway over `sim` workers at a fixed concurrency.

Every request is accounted for as ok, failed or lost (`harness/load.py` says which is which).
The workers' caches are small, so blocks are evicted all the time and the gateway's index churns.
RSS of every process is sampled every few seconds; at the end the gateway's index is compared
with the workers' snapshots.

    .venv/bin/python -m bench.soak                      # 10 minutes, concurrency 16, 3 workers
    .venv/bin/python -m bench.soak --duration 60 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from harness.cluster import Cluster, ClusterSpec
from harness.load import Tally, make_body, one_request
from harness.proc import rss_bytes
from harness.waits import index_mismatches


@dataclass(slots=True)
class SoakConfig:
    duration_s: float = 600.0
    concurrency: int = 16
    workers: int = 3
    num_blocks: int = 160  # small: forces evictions (and BlockRemoved events) all the time
    groups: int = 24  # shared system prompts
    stream_fraction: float = 0.25
    sample_every_s: float = 5.0
    request_timeout_s: float = 60.0
    seed: int = 0
    out_dir: Path = Path("bench/results")

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.concurrency <= 0 or self.workers <= 0:
            raise ValueError("duration, concurrency and workers must be positive")
        if not 0.0 <= self.stream_fraction <= 1.0:
            raise ValueError("stream_fraction must be in [0, 1]")


async def drive(cfg: SoakConfig, gateway_url: str, tally: Tally) -> None:
    deadline = time.monotonic() + cfg.duration_s
    url = f"{gateway_url}/v1/chat/completions"
    limits = httpx.Limits(max_connections=cfg.concurrency * 2)
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits) as client:

        async def client_loop(i: int) -> None:
            rng = random.Random(cfg.seed * 1000 + i)
            while time.monotonic() < deadline:
                body = make_body(rng, cfg.groups)
                body["stream"] = rng.random() < cfg.stream_fraction
                await one_request(client, url, body, tally)

        await asyncio.gather(*(client_loop(i) for i in range(cfg.concurrency)))


async def sample_rss(cluster: Cluster, every: float, out: list[dict], stop: asyncio.Event) -> None:
    t0 = time.monotonic()
    while True:
        row: dict = {"t": round(time.monotonic() - t0, 1)}
        for p in [*cluster.gateways, *cluster.workers]:
            row[p.name] = rss_bytes(p.pid) if p.pid is not None else None
        out.append(row)
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except TimeoutError:
            pass


def progress_every(duration_s: float) -> float:
    """About ten progress lines per run, at most one every 30 s and at least 5 s apart."""
    return min(30.0, max(5.0, duration_s / 10))


async def report_progress(
    cfg: SoakConfig, tally: Tally, samples: list[dict], stop: asyncio.Event
) -> None:
    """A line every few seconds while the load runs: elapsed time, counts, gateway RSS."""
    t0, every = time.monotonic(), progress_every(cfg.duration_s)
    while True:
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except TimeoutError:
            pass
        elapsed = time.monotonic() - t0
        done = tally.ok + tally.failed + tally.lost
        rss = samples[-1].get("gateway-0") if samples else None
        print(
            f"soak {elapsed:5.0f}/{cfg.duration_s:.0f} s: {done} requests "
            f"({done / elapsed:.1f}/s), ok {tally.ok}, failed {tally.failed}, lost {tally.lost}"
            + (f"; gateway RSS {rss / 2**20:.0f} MiB" if rss else ""),
            flush=True,
        )


async def soak(cfg: SoakConfig, cluster: Cluster) -> tuple[Tally, list[dict], float]:
    tally, samples, stop = Tally(), [], asyncio.Event()
    sampler = asyncio.create_task(sample_rss(cluster, cfg.sample_every_s, samples, stop))
    progress = asyncio.create_task(report_progress(cfg, tally, samples, stop))
    t0 = time.monotonic()
    await drive(cfg, cluster.gateway_url, tally)
    elapsed = time.monotonic() - t0
    stop.set()
    await asyncio.gather(sampler, progress)
    return tally, samples, elapsed


def rss_summary(samples: list[dict]) -> dict[str, dict[str, float]]:
    names = [k for k in samples[0] if k != "t"]
    summary = {}
    for name in names:
        vals = [s[name] for s in samples if s.get(name) is not None]
        if vals:
            mib = 1024 * 1024
            summary[name] = {
                "start_mib": round(vals[0] / mib, 1),
                "end_mib": round(vals[-1] / mib, 1),
                "max_mib": round(max(vals) / mib, 1),
            }
    return summary


def run(cfg: SoakConfig) -> dict:
    spec = ClusterSpec(
        workers=cfg.workers,
        engine="sim",
        num_blocks=cfg.num_blocks,
        gateway_args=("--poll-interval", "0.5"),
        worker_args=("--sim-prefill-s-per-token", "0.00005", "--sim-decode-s-per-step", "0.005"),
        log_dir=cfg.out_dir / "logs" / "soak",
        startup_timeout=120,
    )
    print(
        f"soak: starting {cfg.workers} sim workers and a gateway; then {cfg.duration_s:.0f} s at "
        f"concurrency {cfg.concurrency}, a progress line every "
        f"{progress_every(cfg.duration_s):.0f} s",
        flush=True,
    )
    with Cluster(spec) as cluster:
        tally, samples, elapsed = asyncio.run(soak(cfg, cluster))
        print("soak: load done; checking that the gateway's index converges...", flush=True)
        # Idle now: the index must settle to exactly what the workers hold.
        mismatches: dict[str, str] = {}
        for _ in range(50):
            mismatches = index_mismatches(cluster.gateway_url, cluster.worker_urls)
            if not mismatches:
                break
            time.sleep(0.2)
        metrics = httpx.get(f"{cluster.gateway_url}/metrics", timeout=10).text
    lat = sorted(tally.latencies)
    total = tally.ok + tally.failed + tally.lost
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "elapsed_s": round(elapsed, 1),
        "requests": total,
        "ok": tally.ok,
        "failed": tally.failed,
        "lost": tally.lost,
        "failed_reasons": tally.failed_reasons,
        "lost_reasons": tally.lost_reasons,
        "requests_per_s": round(total / elapsed, 1) if elapsed else 0.0,
        "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
        "latency_p99_s": round(lat[int(len(lat) * 0.99)], 3) if lat else None,
        "index_converged": not mismatches,
        "index_mismatches": mismatches,
        "gateway_counters": _counters(metrics),
        "rss": rss_summary(samples),
        "rss_samples": samples,
    }


def _counters(metrics_text: str) -> dict[str, float]:
    wanted = (
        "kvgate_retries_total",
        "kvgate_event_gaps_total",
        "kvgate_event_replays_total",
        "kvgate_event_resyncs_total",
        "kvgate_index_blocks",
    )
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in wanted:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def print_report(res: dict) -> None:
    print(
        f"soak: {res['requests']} requests in {res['elapsed_s']} s "
        f"({res['requests_per_s']}/s): ok {res['ok']}, failed {res['failed']}, lost {res['lost']}"
    )
    print(f"latency p50 {res['latency_p50_s']} s, p99 {res['latency_p99_s']} s")
    print(f"index converged to the workers' snapshots: {res['index_converged']}")
    print(f"{'process':<12}{'RSS start':>12}{'RSS end':>12}{'RSS max':>12}  (MiB)")
    for name, r in res["rss"].items():
        print(f"{name:<12}{r['start_mib']:>12}{r['end_mib']:>12}{r['max_mib']:>12}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=".venv/bin/python -m bench.soak", description=__doc__.split("\n")[0]
    )
    d = SoakConfig()
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--num-blocks", type=int, default=d.num_blocks)
    p.add_argument("--stream-fraction", type=float, default=d.stream_fraction)
    p.add_argument("--out", type=Path, default=d.out_dir / "soak.json")
    args = p.parse_args(argv)
    cfg = SoakConfig(
        duration_s=args.duration,
        concurrency=args.concurrency,
        workers=args.workers,
        num_blocks=args.num_blocks,
        stream_fraction=args.stream_fraction,
        out_dir=args.out.parent,
    )
    res = run(cfg)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print_report(res)
    print(f"wrote {args.out}")
    return 0 if res["lost"] == 0 and res["index_converged"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
