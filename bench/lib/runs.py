"""Runs of the shared-prefix chat workload against sim or torch clusters, as the policy
benchmarks (`bench.hit_rate`, `bench.ttft`, `bench.peers`) make them: the workload's
command-line knobs, cold caches between policies, worker-counter deltas around a run, and the
upper bound of one worker holding all N caches."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cachekey.headers import POLICY_HEADER, SESSION_HEADER
from harness import worker_metrics as wm
from harness.cluster import Cluster, ClusterSpec
from harness.driver import Result, run_workload
from harness.workload import Turn, Workload, WorkloadSpec

# Long enough for AllBlocksCleared to reach the gateway and its speculative entries (2 s) to expire.
SETTLE_S = 2.5


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload knobs every policy benchmark shares (the tenant count is each one's own)."""
    ap.add_argument("--users-per-tenant", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-words", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)


def workload_spec(args: argparse.Namespace, tenants: int, **extra: int) -> WorkloadSpec:
    return WorkloadSpec(
        tenants=tenants,
        users_per_tenant=args.users_per_tenant,
        turns=args.turns,
        system_words=args.system_words,
        seed=args.seed,
        **extra,
    )


def session_header(turn: Turn) -> dict[str, str]:
    return {SESSION_HEADER: turn.conversation}


def reset_caches(workers: list[str]) -> None:
    """Cold caches for the next run, and time for the gateway to hear of it."""
    wm.reset_prefix_caches(workers)
    time.sleep(SETTLE_S)


@dataclass(slots=True)
class Measured:
    results: list[Result]
    per_worker: dict[str, wm.WorkerCounters]  # counter deltas over the run
    seconds: float


def drive(
    url: str,
    workers: list[str],
    workload: Workload,
    *,
    concurrency: int,
    headers: dict[str, str] | None = None,
    headers_for: Callable[[Turn], dict[str, str]] | None = None,
    stream: bool = False,
    timeout: float = 120.0,
) -> Measured:
    """Serve `workload` through `url`, reading the `workers`' counters before and after."""
    before = wm.scrape_all(workers)
    t0 = time.perf_counter()
    results = asyncio.run(
        run_workload(
            url,
            workload,
            concurrency=concurrency,
            headers=headers,
            headers_for=headers_for,
            stream=stream,
            timeout=timeout,
        )
    )
    seconds = time.perf_counter() - t0
    return Measured(results, wm.deltas(before, wm.scrape_all(workers)), seconds)


def drive_policy(
    cluster: Cluster,
    workload: Workload,
    policy: str,
    *,
    concurrency: int,
    on_start: Callable[[], object] | None = None,
    **kwargs,
) -> Measured:
    """One policy's run through the cluster's gateway, on cold caches, each conversation
    pinned by its session header (for the `session` policy). `on_start` is called once the
    caches are reset and settled, as the first request goes. `kwargs` go to `drive`."""
    cluster.reset_prefix_caches()
    time.sleep(SETTLE_S)
    if on_start is not None:
        on_start()
    return drive(
        cluster.gateway_url,
        cluster.worker_urls,
        workload,
        concurrency=concurrency,
        headers={POLICY_HEADER: policy},
        headers_for=session_header,
        **kwargs,
    )


def upper_bound(
    workload: Workload,
    *,
    replicas: int,
    num_blocks: int,
    concurrency: int,
    log_dir: Path,
    headers_for: Callable[[Turn], dict[str, str]] | None = None,
) -> Measured:
    """One sim worker with `replicas` x `num_blocks` blocks serving the trace directly: a
    perfect router over the N caches can approach its hit rate, never beat it."""
    spec = ClusterSpec(
        workers=1, engine="sim", num_blocks=num_blocks * replicas, gateways=0, log_dir=log_dir
    )
    with Cluster(spec) as c:
        return drive(
            c.worker_urls[0],
            c.worker_urls,
            workload,
            concurrency=concurrency,
            headers_for=headers_for,
        )


def records(m: Measured, policy: str, round_: int) -> list[dict]:
    """The answered requests, in the order they were sent: where each went, what the gateway
    predicted of its cache and the worker reported, when it was sent and its times."""
    t0 = min((r.sent_at for r in m.results), default=0.0)
    return [
        {
            "policy": policy,
            "round": round_,
            "conversation": r.conversation,
            "turn": r.turn,
            "replica": r.replica,
            "predicted": r.predicted_cached_tokens,
            "reported": r.cached_tokens,
            "prompt_tokens": r.prompt_tokens,
            "sent_s": round(r.sent_at - t0, 3),
            "ttft_s": r.ttft_s,
            "latency_s": r.latency_s,
        }
        for r in sorted(m.results, key=lambda r: r.sent_at)
        if r.ok
    ]
