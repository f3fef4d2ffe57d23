"""Pace: how often each of many per-worker periodic tasks runs (polls, event tail checks).

Each task runs every `interval` seconds while that keeps all of them together within
`max_per_second`; past that, every task stretches its period to `members / max_per_second`, so
a gateway's background work stays bounded however many workers it fronts (docs/kubernetes.md,
"Sizing"). Each task waits a random share of its first period, then its period give or take 10%:
tasks started together (every worker at a gateway's start) do not stay in step.
"""

from __future__ import annotations

import random


class Pace:
    def __init__(self, interval: float, max_per_second: float | None = None) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        if max_per_second is not None and max_per_second <= 0:
            raise ValueError("max_per_second must be positive (None: no bound)")
        self.interval = interval
        self.max_per_second = max_per_second
        self.members = 0
        self._rng = random.Random()

    def join(self) -> None:
        self.members += 1

    def leave(self) -> None:
        self.members = max(self.members - 1, 0)

    def period(self) -> float:
        if self.max_per_second is None:
            return self.interval
        return max(self.interval, self.members / self.max_per_second)

    def first_delay(self) -> float:
        """Before a task's second run: a random point of one period."""
        return self._rng.uniform(0.0, self.period())

    def delay(self) -> float:
        """Between two runs."""
        return self.period() * self._rng.uniform(0.9, 1.1)
