"""Reading a Prometheus text page, the one parser the harness and the benchmarks use: its samples
(`samples`), one metric summed or by labels at a URL (`metric_total`, `metric_by_labels`),
counters summed over their labels, histograms by bucket, and quantiles of the difference between
two scrapes (what `histogram_quantile(rate(...))` shows on a dashboard)."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import httpx

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def samples(text: str) -> Iterator[tuple[str, str, float]]:
    """(name, its labels as written, value) of every sample of a page (comments skipped)."""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        try:
            v = float(value)
        except ValueError:
            continue
        yield name, labels, v


def labels_of(written: str) -> dict[str, str]:
    """A sample's labels as written (`a="x",b="y\\"z"}`), as a dict."""
    return {
        k: re.sub(r"\\.", lambda m: _ESCAPES.get(m[0], m[0]), v) for k, v in _LABEL.findall(written)
    }


def metric_total(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    """Sum of every sample of one metric at `url`/metrics (0 when absent); `headers` for a
    worker that wants its token."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    return sum(v for n, _, v in samples(text) if n == name)


def metric_by_labels(url: str, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """One metric's samples at `url`/metrics keyed by the values of `labels` (summed over the
    rest), e.g. `metric_by_labels(gw, "kvgate_requests_total", "replica", "status")`."""
    out: dict[tuple[str, ...], float] = {}
    for n, written, v in samples(httpx.get(f"{url}/metrics", timeout=10).text):
        if n == name:
            have = labels_of(written)
            key = tuple(have.get(label, "") for label in labels)
            out[key] = out.get(key, 0.0) + v
    return out


@dataclass(slots=True)
class Scrape:
    """Every sample of one page: `totals` by name (labels summed away), `buckets` by histogram
    name -> upper bound -> cumulative count (summed over the other labels)."""

    totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        out = cls()
        for name, labels, v in samples(text):
            out.totals[name] += v
            if name.endswith("_bucket"):
                le = _label(labels, "le")
                if le is not None:
                    by = out.buckets.setdefault(name[: -len("_bucket")], defaultdict(float))
                    by[float(le)] += v
        return out

    def total(self, name: str) -> float:
        return self.totals.get(name, 0.0)


def _label(labels: str, key: str) -> str | None:
    start = labels.find(f'{key}="')
    if start < 0:
        return None
    start += len(key) + 2
    return labels[start : labels.index('"', start)]


def combined(scrapes: Iterable[Scrape]) -> Scrape:
    """Several processes' pages as one (their counters and buckets added)."""
    out = Scrape()
    for s in scrapes:
        for name, v in s.totals.items():
            out.totals[name] += v
        for name, by in s.buckets.items():
            mine = out.buckets.setdefault(name, defaultdict(float))
            for le, n in by.items():
                mine[le] += n
    return out


def delta(after: Scrape, before: Scrape) -> Scrape:
    """What happened between two scrapes of the same processes."""
    out = Scrape()
    for name, v in after.totals.items():
        out.totals[name] = v - before.totals.get(name, 0.0)
    for name, by in after.buckets.items():
        old = before.buckets.get(name, {})
        out.buckets[name] = {le: n - old.get(le, 0.0) for le, n in by.items()}
    return out


def quantile(s: Scrape, name: str, q: float) -> float | None:
    """The `q` quantile of histogram `name`, interpolated within its bucket as Prometheus's
    histogram_quantile does; None without observations. Past the last finite bucket it is that
    bucket's bound (the true value is larger)."""
    by = s.buckets.get(name)
    if not by:
        return None
    bounds = sorted(by)
    total = by[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = by[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, count
    return lower
