"""Circuit breaker: a replica failing `eject_after_failures` times in a row is ejected.

An ejected replica takes no traffic for `eject_seconds`, and after that only once a /health
probe has found it healthy again (the poller sets `healthy`). A success resets the streak.

Each replica has its own `Circuit` (its count of failures in a row and, while it is open, when it
closes again), changed only through its verbs (`succeed`, `fail`, `close`), which the gateway's
`CircuitBreaker` calls; the rest of the gateway asks it `is_open`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from gateway.config import GatewayConfig
from gateway.fleet.health_state import HealthState
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Circuit:
    """One replica's circuit: closed while it counts failures in a row, open until `open_until`."""

    failures: int = 0  # in a row, while closed
    open_until: float = 0.0  # monotonic time; the replica is ejected before it

    def is_open(self, now: float) -> bool:
        return now < self.open_until

    def close(self) -> None:
        """End an ejection now (and forget the streak)."""
        self.failures = 0
        self.open_until = 0.0

    def succeed(self) -> None:
        self.failures = 0

    def fail(self, threshold: int, seconds: float, now: float) -> int:
        """Count one failure; the streak that opened the circuit (0: it stays closed)."""
        self.failures += 1
        if self.failures < threshold:
            return 0
        streak, self.failures = self.failures, 0
        self.open_until = now + seconds
        return streak


class Breakable(Protocol):
    """What the breaker reads and sets on a replica (gateway.fleet.replica.Replica)."""

    id: str
    name: str
    circuit: Circuit
    healthy: bool
    health: HealthState

    @property
    def where(self) -> str: ...


class CircuitBreaker:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.threshold = config.eject_after_failures
        self.eject_seconds = config.eject_seconds
        self.metrics = metrics

    def success(self, rep: Breakable) -> None:
        rep.circuit.succeed()

    def failure(self, rep: Breakable, reason: str) -> None:
        streak = rep.circuit.fail(self.threshold, self.eject_seconds, time.monotonic())
        if not streak:
            return
        log.warning(
            "ejecting %s for %.1fs after %d failures in a row (last: %s)",
            rep.where, self.eject_seconds, streak, reason,
        )  # fmt: skip
        rep.health.down_reason = f"ejected after {streak} failures in a row (last: {reason})"
        rep.healthy = False  # back only after a good /health probe
        self.metrics.replica_healthy.labels(rep.name).set(0)
