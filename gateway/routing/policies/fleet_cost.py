"""What cache_aware prices with: the `Cost` of a request on a replica (its terms, in seconds),
the candidates' pooled latency model, and the per-token rates.

The learned price of an uncached token is the pooled TTFT fit's `per_token`: the marginal
seconds a prompt token adds to a first token. The workers' measured prefill rate
(`measured_rate`: prefill time over computed tokens) is not: every prefill pays at least one
engine step whatever it computes, so on a fleet whose requests hit the cache it reads several
times the marginal price (the calibrated sim without server cost, the docs' workload: 51 to
245 us a token measured against 26-33 us learned, rising with the hit rate; docs/benchmarks.md,
*Routing in the calibrated sim*, step 6). Priced at it, a miss cost 2-8x what the fleet's
timings say and no imbalance could outweigh a hit. The step a prefill pays whatever it computes
is priced per request, where it belongs (`FleetFit.slowdown`, gateway/fleet/latency.py). The
measured rate is kept only as a tie-breaker: `TIE_SHARE` of it floors the learned price, so
where a recompute looks free (a sim worker without timings) a hit still wins.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from gateway.fleet.latency import FleetFit, fleet_fit
from gateway.fleet.replica import Replica
from gateway.names import ReplicaId

FLEET_SAMPLE = 32  # fitted candidates whose samples are pooled (bounded per request)
TIE_SHARE = 0.1  # of the measured prefill rate: the least the learned model prices a token at


@dataclass(slots=True)
class Cost:
    """Estimated seconds; the total is the sum of the terms (a new term joins as a field)."""

    queue: float
    prefill: float
    interference: float
    spread: float
    adapter: float = 0.0
    busy: float = 0.0
    load: float = 0.0
    evict: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.queue
            + self.prefill
            + self.interference
            + self.spread
            + self.adapter
            + self.busy
            + self.load
            + self.evict
        )


def learned_rate(fleet: FleetFit, floor: float) -> float:
    """Seconds per uncached token by the pooled fit, never below `TIE_SHARE` of the measured
    prefill rate `floor` (a tie-breaker: see the module docstring)."""
    return max(fleet.ttft.per_token, TIE_SHARE * floor)


def fleet_model(replicas: list[Replica]) -> FleetFit | None:
    """The fits of (up to `FLEET_SAMPLE` of) the fitted candidates' samples pooled; None while
    none is fitted."""
    fitted = []
    for r in replicas:
        if r.latency.fitted:
            fitted.append(r)
            if len(fitted) == FLEET_SAMPLE:
                break
    return fleet_fit([r.latency for r in fitted], [r.duration for r in fitted])


def measured_rate(replicas: list[Replica]) -> float:
    """`fleet_rate` when some candidate's rate is measured, else 0."""
    measured = [
        r.prefill_rate.seconds_per_token for r in replicas if r.prefill_rate.seconds_per_token
    ]
    return statistics.median(measured) if measured else 0.0


def fleet_rate(replicas: list[Replica]) -> float:
    """Seconds per prompt token for every candidate before a model is fitted: the median of
    their measured rates; with none measured, 1 (costs are then in tokens).

    One rate for all, not each replica's own: a replica's measured rate is its prefills' time
    over the tokens they computed, and each prefill also pays a floor (at least one engine step)
    whatever it computes. A replica serving cache hits computes few tokens per request, so its
    rate reads several times higher than an equal replica's that takes new prefixes; at its own
    rate every new prefix would then go to the replica that took the last ones, until its cache
    overflows. The median keeps the costs in seconds without that feedback."""
    return measured_rate(replicas) or 1.0


def evicted_tokens(
    r: Replica, uncached: int, block_size: int, cached: Callable[[ReplicaId], int] | None
) -> int:
    """Cached tokens `uncached` new prompt tokens would push out of `r`'s GPU cache: the blocks
    they fill beyond its free ones (its size less the blocks the index holds there). 0 where
    its size is not known (a worker that reports none) or it has room."""
    size = r.slot.num_blocks if r.slot is not None else None
    if not uncached or not size or cached is None:
        return 0
    need = -(-uncached // block_size)
    return max(need - max(size - cached(r.id), 0), 0) * block_size


def dropped_tokens(
    r: Replica, evicted: int, block_size: int, host: Callable[[ReplicaId], int] | None
) -> int | None:
    """Of `evicted` tokens pushed out of `r`'s GPU cache, those its host tier then drops to
    make room (a kvgate worker copies every evicted block there, and its tier is an LRU of its
    own): the blocks beyond the tier's free ones. None where `r` has no host tier, or its size
    or contents are not known: every evicted token is then lost."""
    size = r.slot.host_num_blocks if r.slot is not None else None
    if not size or host is None:
        return None
    moved = -(-evicted // block_size)
    return max(moved - max(size - host(r.id), 0), 0) * block_size


def eviction_seconds(evicted: int, dropped: int | None, rate: float, copy: float) -> float:
    """What the tokens a request pushes out cost the later requests that ask for them, at
    `rate` a recomputed token and `copy` one copied back from the host tier: each evicted
    token lost (no host tier), or moved to the host tier (copied back later), each the tier
    drops to take them having been a copy and becoming a recompute."""
    if dropped is None:
        return evicted * rate
    return evicted * copy + dropped * max(rate - copy, 0.0)
