"""Parity: replicas serving one model must agree on the fingerprint of what determines keys."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)


class Checked(Protocol):
    """What parity reads and sets on a replica (gateway.fleet.replica.Replica)."""

    id: str
    instance_id: str | None
    model: str | None
    fingerprint: str | None
    parity_ok: bool


def check_parity(replicas: Iterable[Checked], metrics: GatewayMetrics) -> None:
    """Mark the replicas whose fingerprint differs from their model's majority as load-only."""
    reps = [r for r in replicas if r.instance_id is not None]
    by_model: dict[str | None, Counter[str | None]] = {}
    for r in reps:
        by_model.setdefault(r.model, Counter())[r.fingerprint] += 1
    for r in reps:
        majority = by_model[r.model].most_common(1)[0][0]
        ok = r.fingerprint == majority
        if not ok and r.parity_ok:
            log.error(
                "replica %s fingerprint %s differs from model %s majority %s: "
                "its index is ignored (routed by load only)",
                r.where,
                r.fingerprint,
                r.model,
                majority,
            )
        r.parity_ok = ok
        metrics.parity_mismatch.labels(r.name).set(0 if ok else 1)
