"""LatencyModel: one replica's time to first token as a function of the load it was sent into,
learned online from what the gateway sees.

Every request the gateway proxies is a sample: when it is placed (`Lease.take`) the features of
the replica then, and at its first byte back the seconds it took. The model is linear,

  TTFT = base + per_token * its uncached prompt tokens + per_queued * prefill tokens queued there
       + per_request * requests there (the gateway's in flight or the worker's running + waiting)

fitted by recursive least squares with forgetting (`FORGET`: a few hundred samples' memory, so
it follows a worker that slows down), from a weak prior, so the first samples do not swing it.
Prediction clamps each coefficient at 0 (a fit on collinear load features can go negative for
one of them; the time a request adds is never negative).

`per_request` is also what one more request adds to the requests already there: on a GPU worker
a request's host work and its prefill step stall every stream it shares the engine with. The
cache_aware policy prices that slowdown with it (docs/gateway.md, "The cost model").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

FORGET = 0.995  # weight of the past per sample
PRIOR_VARIANCE = 1.0  # of each coefficient in its scaled unit (weak: the data decides)
MIN_SAMPLES = 8  # before this many, a replica borrows the fleet's fitted coefficients
TOKEN_UNIT = 1000.0  # tokens per feature unit (keeps the fit well conditioned)
ERROR_SMOOTHING = 0.05  # weight of the newest sample in the mean relative error

N = 4  # features: 1, uncached / TOKEN_UNIT, queued / TOKEN_UNIT, requests there


def features(uncached: int, queued: int, requests: float) -> tuple[float, ...]:
    return (1.0, uncached / TOKEN_UNIT, queued / TOKEN_UNIT, float(requests))


@dataclass(slots=True)
class Coefficients:
    """Seconds: at zero load, per uncached token, per queued prefill token, per request there."""

    base: float
    per_token: float
    per_queued: float
    per_request: float

    def ttft(self, uncached: int, queued: int, requests: float) -> float:
        return (
            self.base
            + self.per_token * uncached
            + self.per_queued * queued
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
    theta: list[float] = field(default_factory=lambda: [0.0] * N)
    p: list[list[float]] = field(
        default_factory=lambda: [[PRIOR_VARIANCE * (i == j) for j in range(N)] for i in range(N)]
    )
    samples: int = 0
    mean_error: float = 0.0  # smoothed |observed - predicted| / observed, of its samples
    _fitted: Coefficients | None = None

    @property
    def fitted(self) -> bool:
        return self.samples >= MIN_SAMPLES

    def coefficients(self) -> Coefficients:
        """The clamped coefficients in seconds (cached until the next sample)."""
        if self._fitted is None:
            b, t, q, r = (max(v, 0.0) for v in self.theta)
            self._fitted = Coefficients(b, t / TOKEN_UNIT, q / TOKEN_UNIT, r)
        return self._fitted

    def start(self, uncached: int, queued: int, requests: float) -> Sample:
        """A request placed here now, into that load (its own tokens not yet counted)."""
        expected = self.coefficients().ttft(uncached, queued, requests) if self.fitted else None
        return Sample(features(uncached, queued, requests), time.monotonic(), expected)

    def finish(self, sample: Sample) -> float | None:
        """Its first token came back now: learn from it. Returns |observed - expected| /
        observed (None: nothing was expected, the model was not fitted yet)."""
        seconds = time.monotonic() - sample.sent_at
        expected = sample.expected
        self.observe(sample.x, seconds, expected)
        if expected is None or seconds <= 0:
            return None
        return abs(seconds - expected) / seconds

    def observe(self, x: tuple[float, ...], seconds: float, predicted: float | None) -> None:
        """One request's TTFT, sent into load `x`; `predicted`: what was expected of it then."""
        if predicted is not None and seconds > 0:
            err = abs(seconds - predicted) / seconds
            self.mean_error += ERROR_SMOOTHING * (err - self.mean_error)
        p, theta = self.p, self.theta
        px = [sum(p[i][j] * x[j] for j in range(N)) for i in range(N)]
        denom = FORGET + sum(x[i] * px[i] for i in range(N))
        gain = [v / denom for v in px]
        residual = seconds - sum(theta[i] * x[i] for i in range(N))
        for i in range(N):
            theta[i] += gain[i] * residual
        for i in range(N):
            for j in range(N):
                p[i][j] = (p[i][j] - gain[i] * px[j]) / FORGET
        self.samples += 1
        self._fitted = None


def fleet_coefficients(models: list[LatencyModel]) -> Coefficients | None:
    """The coefficient-wise median of the fitted models (None: none fitted yet): what a replica
    with too few samples of its own is priced by."""
    fitted = [m.coefficients() for m in models if m.fitted]
    if not fitted:
        return None

    def median(values: list[float]) -> float:
        values = sorted(values)
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    return Coefficients(
        median([c.base for c in fitted]),
        median([c.per_token for c in fitted]),
        median([c.per_queued for c in fitted]),
        median([c.per_request for c in fitted]),
    )
