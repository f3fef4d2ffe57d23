"""Dropped KV-event messages over real ZMQ: a gap is closed by replay, or by the snapshot when
the worker's replay buffer no longer holds the missing batches.

The worker's fault hook (`POST /debug/fault?kind=drop_events&count=N`) withholds the next N
batches from PUB while keeping them in the replay buffer, which is what a lost message looks
like to a subscriber. Traffic goes straight to the worker, so the batches it publishes are
exactly the ones the test drives.
"""

from __future__ import annotations

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.proc import Proc
from harness.prom import metric_total
from harness.waits import index_mismatches, wait_index_converged, wait_until

pytestmark = pytest.mark.slow


def _complete(worker: Proc, i: int) -> None:
    body = {
        "model": "demo",
        "prompt": f"conversation {i}: " + "tell me more " * 12,
        "max_tokens": 3,
    }
    r = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text


def _drive_until(worker: Proc, cond, start: int, limit: int = 40) -> int:
    """Send requests one by one until `cond()` holds (each publishes at least one batch)."""
    for i in range(start, start + limit):
        if cond():
            return i
        _complete(worker, i)
    wait_until(cond, 5, "the gateway to react to the gap")
    return start + limit


def _drop(worker: Proc, n: int) -> None:
    r = httpx.post(f"{worker.url}/debug/fault", params={"kind": "drop_events", "count": n})
    assert r.status_code == 200, r.text


def test_dropped_batches_gap_replay_and_snapshot_resync(tmp_path):
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=128,
        # The idle replay check would find every withheld batch before the 2-batch buffer rolls
        # over; this test is about gaps the live stream reveals, so it is kept out of the way.
        gateway_args=("--poll-interval", "0.2", "--event-tail-check-interval", "600"),
        worker_args=("--enable-fault-injection",),
        # Worker 1 keeps only 2 batches for replay: a longer gap can only be closed by a snapshot.
        per_worker_args=((), ("--kv-events-buffer", "2")),
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        gw, roomy, tight = c.gateway_url, c.workers[0], c.workers[1]
        index = lambda: httpx.get(f"{gw}/kvgate/index").json()["replicas"]  # noqa: E731
        wait_until(lambda: all(r["synced"] for r in index().values()), 15, "synced")
        for i in range(4):
            _complete(roomy, i)
            _complete(tight, i)
        wait_index_converged(gw, c.worker_urls)
        gaps = metric_total(gw, "kvgate_event_gaps_total")
        replays = metric_total(gw, "kvgate_event_replays_total")
        resyncs = metric_total(gw, "kvgate_event_resyncs_total")
        assert gaps == replays == 0

        # 1. Three batches lost, all still buffered: the next delivered batch reveals the gap
        # and a replay fills it. No snapshot is needed.
        _drop(roomy, 3)
        n = _drive_until(
            roomy, lambda: metric_total(gw, "kvgate_event_replays_total") > replays, 10
        )
        assert metric_total(gw, "kvgate_event_gaps_total") == gaps + 1
        assert metric_total(gw, "kvgate_event_resyncs_total") == resyncs
        wait_index_converged(gw, [roomy.url])

        # While batches are being withheld the index really is behind: the fault is real.
        _drop(tight, 6)
        _complete(tight, 100)  # a few batches, all withheld
        assert tight.url in index_mismatches(gw, [tight.url])

        # 2. More lost than the 2-batch buffer holds: replay cannot cover, the snapshot does.
        _drive_until(tight, lambda: metric_total(gw, "kvgate_event_resyncs_total") > resyncs, n)
        assert metric_total(gw, "kvgate_event_gaps_total") == gaps + 2
        wait_index_converged(gw, c.worker_urls)
        assert index()[tight.url]["blocks"] > 0

        # And the stream goes on normally afterwards.
        for i in range(3):
            _complete(tight, 200 + i)
            _complete(roomy, 200 + i)
        wait_index_converged(gw, c.worker_urls)
