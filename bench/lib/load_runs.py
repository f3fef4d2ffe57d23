"""What the routing-under-load benchmarks (`bench.under_load`, `bench.index_modes`) share: the
held-out trace, sim workers that charge GPU-like time, caches sized to a third of the working
set, and one row of latency, TTFT, hit rate and prediction accuracy per run."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.lib.report import Col, percentile
from bench.lib.runs import Measured, drive, reset_caches
from cachekey.headers import POLICY_HEADER
from harness.driver import Result, hit_rate, warm_results
from harness.prom import metric_total
from harness.workload import Workload, WorkloadSpec

# The workers: 200 us per uncached prompt token, 2 ms per engine step.
SIM_COST = ("--sim-prefill-s-per-token", "0.0002", "--sim-decode-s-per-step", "0.002")
GATEWAY_ARGS = ("--poll-interval", "0.2")
# Held out: the routing work was developed on seed 0; the tables use seed 1.
SEED = 1


def trace(hot: bool, seed: int = SEED, tenants: int = 24, users: int | None = None) -> Workload:
    """96 conversations of 3 turns in 24 tenants; hot: one tenant holds half of ~92 of them.
    `tenants` and `users` (per tenant) change how many prefixes the conversations share."""
    users = users if users is not None else 2 if hot else 4
    return Workload(
        WorkloadSpec(
            tenants=tenants,
            users_per_tenant=users,
            turns=3,
            system_words=1200,
            seed=seed,
            hot_share=0.5 if hot else 0.0,
        )
    )


def working_set_blocks(workload: Workload, block_size: int = 16) -> int:
    """Distinct full blocks of the trace as the demo model renders it (replies as 8 words)."""
    from cachekey.assets import ModelAssets
    from cachekey.keys import HashNamespace, block_keys
    from cachekey.render import Renderer
    from worker.demo.model import ensure_demo_model

    renderer = Renderer(ModelAssets.from_dir(ensure_demo_model()))
    ns = HashNamespace("demo", block_size)
    histories: dict[str, list[dict]] = {}
    keys: set[bytes] = set()
    for turn in workload:
        msgs = histories.setdefault(turn.conversation, workload.initial_messages(turn.tenant))
        msgs.append({"role": "user", "content": turn.content})
        prompt = renderer.render_chat(msgs)
        keys.update(block_keys(prompt.token_ids, ns, prompt.mm_items))
        msgs.append({"role": "assistant", "content": "word " * 8})
    return len(keys)


def blocks_per_worker(workload: Workload) -> int:
    """Each worker's cache holds about a third of the working set."""
    return math.ceil(working_set_blocks(workload) / 3)


@dataclass(slots=True)
class LoadRow:
    label: str  # what varies between rows (variant, gateways, index mode)
    concurrency: int
    policy: str
    requests: int
    failed: int
    hit_rate: float
    exact: float | None  # share of requests whose predicted == reported cached tokens
    latency_p50_ms: float
    latency_p99_ms: float
    # p99 of the requests sent once the opening burst was served (`warm_results`): the
    # tail of the traffic that follows a cold start, not of the start itself.
    warm_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    spills: int
    seconds: float
    load_avg: float  # the host's 1-minute load average at the end of the run
    # Each request: (conversation, turn, replica, prompt, cached, predicted, latency s, TTFT s,
    # sent s after the run's first request).
    detail: list[tuple] = field(default_factory=list, repr=False)
    ttft_p90_ms: float = 0.0
    requests_per_s: float = 0.0  # answered requests over the run's wall time


COLUMNS = (
    Col("label", "run", 12, left=True),
    Col("concurrency", "conc", 5),
    Col("policy", "policy", 14, left=True, sep=" "),
    Col("requests", "reqs", 5),
    Col("failed", "fail", 5),
    Col("hit_rate", "hit", 7, ".1%"),
    Col("exact", "exact", 7, ".1%"),
    Col("latency_p50_ms", "lat p50", 9, ".0f"),
    Col("latency_p99_ms", "lat p99", 9, ".0f"),
    Col("warm_p99_ms", "p99 warm", 9, ".0f"),
    Col("ttft_p50_ms", "ttft p50", 9, ".0f"),
    Col("ttft_p90_ms", "ttft p90", 9, ".0f"),
    Col("ttft_p99_ms", "ttft p99", 9, ".0f"),
    Col("requests_per_s", "req/s", 7, ".1f"),
    Col("spills", "spills", 7),
    Col("seconds", "s", 7, ".1f"),
    Col("load_avg", "load", 6, ".1f"),
)


def summarize(label: str, concurrency: int, policy: str, m: Measured, spills: int) -> LoadRow:
    ok = [r for r in m.results if r.ok]
    predicted = [r for r in ok if r.predicted_cached_tokens is not None]
    lat = [r.latency_s * 1000 for r in ok]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    start = min((r.sent_at for r in m.results), default=0.0)
    warm = warm_results(m.results, concurrency)
    return LoadRow(
        label=label,
        concurrency=concurrency,
        policy=policy,
        requests=len(m.results),
        failed=len(m.results) - len(ok),
        hit_rate=hit_rate(m.results),
        exact=_exact(predicted),
        latency_p50_ms=percentile(lat, 0.5),
        latency_p99_ms=percentile(lat, 0.99),
        warm_p99_ms=percentile([r.latency_s * 1000 for r in warm if r.ok], 0.99),
        ttft_p50_ms=percentile(ttft, 0.5),
        ttft_p99_ms=percentile(ttft, 0.99),
        spills=spills,
        ttft_p90_ms=percentile(ttft, 0.9),
        requests_per_s=round(len(ok) / m.seconds, 3) if m.seconds else 0.0,
        seconds=round(m.seconds, 1),
        load_avg=os.getloadavg()[0],
        detail=[
            (
                r.conversation,
                r.turn,
                r.replica,
                r.prompt_tokens,
                r.cached_tokens,
                r.predicted_cached_tokens,
                round(r.latency_s, 4),
                None if r.ttft_s is None else round(r.ttft_s, 4),
                round(r.sent_at - start, 4),
            )
            for r in m.results
        ],
    )


def _exact(results: list[Result]) -> float | None:
    if not results:
        return None
    return sum(r.predicted_cached_tokens == r.cached_tokens for r in results) / len(results)


def run_once(
    url: str,
    gateways: Sequence[str],
    workers: list[str],
    workload: Workload,
    policy: str,
    concurrency: int,
    label: str,
) -> LoadRow:
    """One policy over the whole trace through `url`, on cold caches, streamed (for TTFT)."""
    reset_caches(workers)
    spills = sum(metric_total(g, "kvgate_route_spills_total") for g in gateways)
    m = drive(
        url,
        workers,
        workload,
        concurrency=concurrency,
        headers={POLICY_HEADER: policy},
        stream=True,
        timeout=300.0,
    )
    spills = sum(metric_total(g, "kvgate_route_spills_total") for g in gateways) - spills
    return summarize(label, concurrency, policy, m, round(spills))
