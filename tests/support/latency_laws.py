"""A fleet of four replicas whose latency models learned the laws the calibrated sim shows
without server cost (docs/benchmarks.md, *Routing in the calibrated sim*, step 6): what
cache_aware's pricing tests rank with."""

from __future__ import annotations

import random

from gateway.fleet.latency import LatencyModel, features
from gateway.fleet.replica import Replica
from gateway.names import ReplicaId


def first_token(uncached: int, queued: int, waiting: int, there: int) -> float:
    """TTFT as the sim shows it without server cost: 70 ms, 27 us an uncached token, 30 ms a
    queued prefill; a decode stream there costs a first token nothing."""
    return 0.070 + 27e-6 * uncached + 2e-6 * queued + 0.030 * waiting


def whole(uncached: int, queued: int, waiting: int, there: int) -> float:
    """The whole time: 350 ms, and 60 ms for each prefill queued there (its step stalls the
    streams)."""
    return 0.350 + 35e-6 * uncached + 0.060 * waiting


def train(model: LatencyModel, law, rng: random.Random) -> None:
    for _ in range(300):
        u, q, k = rng.randrange(0, 2600), rng.randrange(0, 6000), rng.randrange(0, 6)
        w = rng.randrange(0, k + 1)
        model.observe(features(u, q, w, k), law(u, q, w, k) * rng.uniform(0.95, 1.05), None)


def fleet() -> list[Replica]:
    reps = [Replica(ReplicaId(f"http://w{i}"), f"http://w{i}", healthy=True) for i in range(4)]
    rng = random.Random(7)
    for r in reps:
        train(r.latency, first_token, rng)
        train(r.duration, whole, rng)
        # What a fleet serving hits measures: each prefill's step over its few tokens.
        r.prefill_rate.seconds_per_token = 150e-6
    return reps
