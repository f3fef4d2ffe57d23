"""LatencyModel: a replica's time to first token as a function of the load it was sent into,
learned online from what the gateway sees.

Every request the gateway proxies is a sample: when it is placed (`Lease.take`) the load of the
replica then, and at its first byte back the seconds it took. The TTFT model is linear,

  TTFT = base + per_token * its uncached prompt tokens + per_queued * prefill tokens queued there
       + per_waiting * requests queued there (the gateway's without a first token yet)
       + per_request * requests there (the gateway's in flight and what else the worker counts)

fitted by exponentially weighted least squares (`FORGET` per sample: a few hundred samples'
memory, so it follows a worker that slows down) from a weak prior, so the first samples do not
swing it. Each replica keeps its weighted sums (X'X, X'y), so the fit of several replicas
pooled is the solve of their sums (`pooled`): cache_aware prices every candidate with the pooled
fit of the fleet, where the load features vary widely (idle and busy replicas alike), and each
replica's own fit (`coefficients`) is exported and explained. Ranking by each replica's own fit
let equal replicas drift apart: a replica that is always busy cannot tell its base from its
per-request time (its load barely varies), and its price followed that split, not its speed.

A second model of the same form, `Replica.duration`, learns each request's whole time (to the
end of its answer) against the same load: its per-request time is what one more request on a
replica adds to the requests there, their decode included (on a GPU worker a request's host
work and its prefill step stall every stream it shares the engine with); cache_aware charges
that slowdown to the replicas' requests already there (`FleetFit`).

Prediction clamps each coefficient at 0 (collinear load features can push one below 0; the time
a request adds is never negative).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

FORGET = 0.995  # weight of the past per sample
PRIOR = 1e-2  # ridge weight toward 0, in samples' worth of each scaled feature
MIN_SAMPLES = 8  # samples before a replica's own fit counts
TOKEN_UNIT = 1000.0  # tokens per feature unit (keeps the sums well conditioned)
ERROR_SMOOTHING = 0.05  # weight of the newest sample in the mean relative error

N = 5  # features: 1, uncached / TOKEN_UNIT, queued / TOKEN_UNIT, waiting, requests there


def features(uncached: int, queued: int, waiting: int, requests: float) -> tuple[float, ...]:
    return (1.0, uncached / TOKEN_UNIT, queued / TOKEN_UNIT, float(waiting), float(requests))


@dataclass(slots=True)
class Coefficients:
    """Seconds: at zero load, per uncached token, per queued prefill token, per queued request,
    per request there."""

    base: float
    per_token: float
    per_queued: float
    per_waiting: float
    per_request: float

    def ttft(self, uncached: int, queued: int, waiting: int, requests: float) -> float:
        return (
            self.base
            + self.per_token * uncached
            + self.per_queued * queued
            + self.per_waiting * waiting
            + self.per_request * requests
        )


@dataclass(slots=True)
class Sample:
    """A request on its way: the load it was sent into, when, and what was expected of it."""

    x: tuple[float, ...]
    sent_at: float
    expected: float | None


@dataclass(slots=True)
class LatencyModel:
    xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * N for _ in range(N)])
    xty: list[float] = field(default_factory=lambda: [0.0] * N)
    samples: int = 0
    mean_error: float = 0.0  # smoothed |observed - expected| / observed, of its requests
    # The fit the router prices it with (cache_aware sets the pooled fit here): what its
    # requests are predicted by, and their error measured against.
    pool: Coefficients | None = None
    _fitted: Coefficients | None = None

    @property
    def fitted(self) -> bool:
        return self.samples >= MIN_SAMPLES

    def coefficients(self) -> Coefficients:
        """Its own fit, clamped, in seconds (cached until the next sample)."""
        if self._fitted is None:
            self._fitted = solve(self.xtx, self.xty)
        return self._fitted

    def start(self, uncached: int, queued: int, waiting: int, requests: float) -> Sample:
        """A request placed here now, into that load (itself not yet counted); expected by the
        router's fit (`pool`)."""
        load = (uncached, queued, waiting, requests)
        expected = self.pool.ttft(*load) if self.pool is not None else None
        return Sample(features(*load), time.monotonic(), expected)

    def finish(self, sample: Sample) -> float | None:
        """Its first token came back now: learn from it. Returns |observed - expected| /
        observed (None: nothing was expected, no fit priced it yet)."""
        seconds = time.monotonic() - sample.sent_at
        expected = sample.expected
        self.observe(sample.x, seconds, expected)
        if expected is None or seconds <= 0:
            return None
        return abs(seconds - expected) / seconds

    def learn(self, sample: Sample) -> None:
        """The request ended now (the end-to-end model): learn its whole time."""
        self.observe(sample.x, time.monotonic() - sample.sent_at, None)

    def observe(self, x: tuple[float, ...], seconds: float, predicted: float | None) -> None:
        """One request's TTFT, sent into load `x`; `predicted`: what was expected of it then."""
        if predicted is not None and seconds > 0:
            err = abs(seconds - predicted) / seconds
            self.mean_error += ERROR_SMOOTHING * (err - self.mean_error)
        for i in range(N):
            row = self.xtx[i]
            for j in range(N):
                row[j] = FORGET * row[j] + x[i] * x[j]
            self.xty[i] = FORGET * self.xty[i] + x[i] * seconds
        self.samples += 1
        self._fitted = None


def pooled(models: Iterable[LatencyModel]) -> Coefficients | None:
    """One fit over the fitted models' samples together (None: none fitted yet)."""
    xtx = [[0.0] * N for _ in range(N)]
    xty = [0.0] * N
    any_fitted = False
    for m in models:
        if not m.fitted:
            continue
        any_fitted = True
        for i in range(N):
            for j in range(N):
                xtx[i][j] += m.xtx[i][j]
            xty[i] += m.xty[i]
    return solve(xtx, xty) if any_fitted else None


@dataclass(slots=True)
class FleetFit:
    """What cache_aware prices with: the pooled TTFT fit, and `slowdown`, the seconds one more
    request arriving on a replica adds to each request's whole time there (the pooled duration
    fit's `slowdown`; the TTFT fit's while no duration is fitted)."""

    ttft: Coefficients
    slowdown: float


def slowdown(c: Coefficients) -> float:
    """What one more request arriving on a replica adds to a request's time there: it is
    queued first (`per_waiting`: its prefill's step, which every prefill pays whatever it
    computes, stalls every stream there), then one more request there (`per_request`). Both, not
    `per_request` alone: without a worker server cost a decode stream barely slows the others
    (a decode step is 2.6 ms at batch 1, 2.8 ms at 8 on the H200) and the fits put all of a
    replica's load in its queued prefills (the calibrated sim, docs' workload: the duration
    fit's per-request time 0, its per-queued-request 42-86 ms; docs/benchmarks.md step 6)."""
    return c.per_waiting + c.per_request


def fleet_fit(ttft: list[LatencyModel], duration: list[LatencyModel]) -> FleetFit | None:
    """The pooled fits of the replicas' TTFT and duration models (None: no TTFT fit yet)."""
    first = pooled(ttft)
    if first is None:
        return None
    whole = pooled(duration)
    return FleetFit(first, slowdown(whole if whole is not None else first))


def solve(xtx: list[list[float]], xty: list[float]) -> Coefficients:
    """Ridge least squares: (X'X + PRIOR I) theta = X'y, by Gaussian elimination; clamped."""
    a = [[xtx[i][j] + (PRIOR if i == j else 0.0) for j in range(N)] + [xty[i]] for i in range(N)]
    for col in range(N):
        pivot = max(range(col, N), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, N):
            f = a[r][col] / a[col][col]
            for k in range(col, N + 1):
                a[r][k] -= f * a[col][k]
    theta = [0.0] * N
    for i in reversed(range(N)):
        theta[i] = (a[i][N] - sum(a[i][k] * theta[k] for k in range(i + 1, N))) / a[i][i]
    b, t, q, w, r = (max(v, 0.0) for v in theta)
    return Coefficients(b, t / TOKEN_UNIT, q / TOKEN_UNIT, w, r)
