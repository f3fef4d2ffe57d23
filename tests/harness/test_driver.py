"""The benchmark plumbing on a small real cluster: per-request policies, cache resets between
runs, worker-counter deltas and streaming TTFT."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.hit_rate import parser, run_replicas
from bench.lib.floor import startup_floor
from harness import worker_metrics as wm
from harness.cluster import Cluster, ClusterSpec
from harness.driver import run_side_by_side, run_workload
from harness.workload import Workload, WorkloadSpec


def test_max_over_mean_counts_idle_replicas():
    assert wm.max_over_mean([5, 5, 5, 5]) == 1.0
    assert wm.max_over_mean([10, 0]) == 2.0
    assert wm.max_over_mean([]) == 0.0


@pytest.mark.slow
def test_hit_rate_runs_are_cold_and_counted_by_workers(tmp_path: Path):
    small = "--users-per-tenant 2 --turns 2 --system-words 600 --num-blocks 320 --concurrency 1"
    args = parser().parse_args([*small.split(), "--log-dir", str(tmp_path)])
    rows = {r.policy: r for r in run_replicas(2, ["cache_aware", "round_robin"], args)}
    ca, rr, bound = rows["cache_aware"], rows["round_robin"], rows["upper_bound"]
    for r in (ca, rr, bound):
        assert r.failed == 0 and r.requests == 24
        # Every request reached a worker, and the workers' counters agree with the responses.
        assert sum(r.requests_per_replica) == 24
        assert r.worker_hit_rate == pytest.approx(r.hit_rate, abs=1e-9)
    # round_robin alternates strictly; reset caches mean it did not inherit cache_aware's blocks.
    assert rr.requests_per_replica == [12, 12] and rr.max_over_mean == 1.0
    assert ca.hit_rate > rr.hit_rate
    assert bound.hit_rate >= ca.hit_rate * 0.9
    assert bound.blocks_per_replica == 640 and bound.max_over_mean is None


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


def test_warm_p99_counts_only_requests_sent_after_the_opening_burst_was_served():
    from bench.lib.load_runs import summarize
    from bench.lib.runs import Measured
    from harness.driver import Result

    def result(i: int, latency: float, sent: float) -> Result:
        return Result(f"c{i}", 0, "r", 100, 0, 0, latency, latency / 2, True, sent_at=sent)

    # Four requests sent together on cold caches; the last of them is served at t=9.0.
    burst = [result(i, 6.0 + i, 0.001 * i) for i in range(4)]
    # Sent while the burst is still being served: cold starts too, left out.
    echo = [result(4 + i, 5.0, 1.0 + i) for i in range(3)]
    later = [result(7 + i, 1.0 + i / 100, 9.5 + i) for i in range(20)]
    row = summarize("uniform", 4, "cache_aware", Measured(later + echo + burst, {}, 30.0), 0)
    assert row.latency_p99_ms == pytest.approx(9000.0, abs=5)
    assert row.warm_p99_ms == pytest.approx(1190.0)  # the slowest request sent after t=9.0
    assert row.requests == 27 and row.exact == 1.0


def test_start_up_floor_of_the_opening_burst():
    """14 tenants of ~2,450-token prompts over 4 replicas: two replicas take 4 full prefills
    (1.96 s at 200 us/token); with 8-token answers all 4 there end after the last one, which
    is 8 requests, more than the 2 a nearest-rank p99 of 288 lets go."""
    opening = [(f"t{i}", 2450) for i in range(14)] + [("t0", 2500), ("t1", 2400)]
    fl = startup_floor(opening, 288, 4, 0.0002, max_tokens=8, step_tokens=2048)
    assert (fl.tenants, fl.per_replica, fl.busiest) == (14, 4, 2)
    assert fl.seconds == pytest.approx((2400 + 3 * 2450) * 0.0002)  # the 4 cheapest tenants
    assert fl.requests == 8 and fl.binds_p99
    # One-token answers do not wait for the other prefills: only the last on each replica does.
    short = startup_floor(opening, 288, 4, 0.0002, max_tokens=1, step_tokens=2048)
    assert short.requests == 2 and not short.binds_p99
    # As many tenants as replicas: one prefill each, no floor beyond a single prefill.
    assert startup_floor(opening[:4], 288, 4, 0.0002, 8, 2048).per_replica == 1
