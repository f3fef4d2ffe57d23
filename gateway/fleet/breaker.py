"""Circuit breaker: a replica failing `eject_after_failures` times in a row is ejected.

An ejected replica takes no traffic for `eject_seconds`, and after that only once a /health
probe has found it healthy again (the poller sets `healthy`). A success resets the streak.
"""

from __future__ import annotations

import logging
import time

from gateway.config import GatewayConfig
from gateway.fleet.replica import Replica
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)


class CircuitBreaker:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.threshold = config.eject_after_failures
        self.eject_seconds = config.eject_seconds
        self.metrics = metrics

    def success(self, rep: Replica) -> None:
        rep.failures = 0

    def failure(self, rep: Replica, reason: str) -> None:
        rep.failures += 1
        if rep.failures < self.threshold:
            return
        log.warning(
            "ejecting %s for %.1fs after %d failures in a row (last: %s)",
            rep.id, self.eject_seconds, rep.failures, reason,
        )  # fmt: skip
        rep.ejected_until = time.monotonic() + self.eject_seconds
        rep.down_reason = f"ejected after {rep.failures} failures in a row (last: {reason})"
        rep.failures = 0
        rep.healthy = False  # back only after a good /health probe
        self.metrics.replica_healthy.labels(rep.id).set(0)
