"""harness/driver.py and worker_metrics.py, the plumbing every benchmark runs on, on small real
clusters: worker-counter deltas, streaming TTFT, side-by-side runs, the warm tail's requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

from harness import worker_metrics as wm
from harness.cluster import Cluster, ClusterSpec
from harness.driver import Result, run_side_by_side, run_workload, warm_results
from harness.workload import Workload, WorkloadSpec


def test_max_over_mean_counts_idle_replicas():
    assert wm.max_over_mean([5, 5, 5, 5]) == 1.0
    assert wm.max_over_mean([10, 0]) == 2.0
    assert wm.max_over_mean([]) == 0.0


def test_streaming_driver_measures_ttft_and_cached_tokens(tmp_path: Path):
    spec = ClusterSpec(workers=1, engine="sim", gateways=1, log_dir=tmp_path)
    workload = Workload(WorkloadSpec(tenants=1, users_per_tenant=1, turns=2, system_words=200))
    with Cluster(spec) as c:
        before = wm.scrape_all(c.worker_urls)
        results = asyncio.run(run_workload(c.gateway_url, workload, stream=True))
        per = wm.deltas(before, wm.scrape_all(c.worker_urls))
    assert [r.ok for r in results] == [True, True]
    first, second = sorted(results, key=lambda r: r.turn)
    for r in results:
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s
        assert r.replica != "direct"  # the gateway named the replica it chose
    assert first.cached_tokens == 0 and second.cached_tokens > 0
    assert second.predicted_cached_tokens == second.cached_tokens
    counters = per[c.worker_urls[0]]
    assert counters.requests == 2
    assert counters.hit_tokens == second.cached_tokens
    assert counters.prompt_tokens == first.prompt_tokens + second.prompt_tokens
    # The worker timed both first tokens, and the engine's intervals of each lie within them.
    assert counters.first_tokens == counters.admitted == 2
    parts = wm.first_token_parts(per)
    assert parts is not None and parts.queue >= 0 and parts.prefill > 0 and parts.to_engine >= 0
    assert parts.worker <= (first.ttft_s + second.ttft_s) / 2
    assert wm.first_token_parts({}) is None


def test_side_by_side_driver_serves_every_turn_to_each_worker(tmp_path: Path):
    """bench.image_reuse's plumbing: a clamp and a partial sim worker get the same visual-Q&A
    trace turn by turn; partial reuse hits at least as much on every turn, more on some."""
    rules = ("clamp", "partial")
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        gateways=0,
        per_worker_args=[("--mm-match-rule", r) for r in rules],
        log_dir=tmp_path,
    )
    workload = Workload(
        WorkloadSpec(
            tenants=2,
            users_per_tenant=4,
            turns=1,
            system_words=60,
            image_prob=1.0,
            shared_images=1,
            images_per_tenant=0,
            image_first=True,
        )
    )
    assert all(turn.content[0]["type"] == "image_url" for turn in workload)
    with Cluster(spec) as c:
        results = asyncio.run(run_side_by_side(c.worker_urls, workload, stream=True))
    clamp, partial = (results[u] for u in c.worker_urls)
    assert [r.ok for r in clamp + partial] == [True] * 16
    assert [r.conversation for r in clamp] == [t.conversation for t in workload]
    assert [r.conversation for r in partial] == [t.conversation for t in workload]
    assert all(p.cached_tokens >= c.cached_tokens for c, p in zip(clamp, partial, strict=True))
    assert sum(p.cached_tokens for p in partial) > sum(c.cached_tokens for c in clamp)


def test_warm_results_are_the_requests_sent_after_the_opening_burst_was_served():
    def result(i: int, latency: float, sent: float) -> Result:
        return Result(f"c{i}", 0, "r", 100, 0, 0, latency, latency / 2, True, sent_at=sent)

    # Four requests sent together on cold caches; the last of them is served at t=9.0.
    burst = [result(i, 6.0 + i, 0.001 * i) for i in range(4)]
    # Sent while the burst is still being served: cold starts too, left out.
    echo = [result(4 + i, 5.0, 1.0 + i) for i in range(3)]
    later = [result(7 + i, 1.0 + i / 100, 9.5 + i) for i in range(20)]
    assert warm_results(later + echo + burst, 4) == later  # in the order they were sent
    assert warm_results(burst, 4) == [] and warm_results([], 4) == []
