"""HealthState: why a replica takes no traffic, and what of that was logged.

Set by the pollers (health.py, replica_set.py) and the circuit breaker (breaker.py); read for
the gateway's log and its 503s (`Replica.describe`). Whether it is healthy at all stays a flag
on the `Replica` itself: routing reads it for every candidate of every request.
"""

from __future__ import annotations

from dataclasses import dataclass

NOT_POLLED = "not polled yet"


@dataclass(slots=True)
class HealthState:
    down_reason: str | None = NOT_POLLED  # why it is not healthy (None when it is)
    warned_at: float | None = None  # last time its being down was logged
    warned_reason: str | None = None  # the reason logged then
    failed_polls: int = 0  # in a row, on the head replica (replica_set.py)
    info_error: str | None = None  # why its last /kvgate/info was refused (logged once)
