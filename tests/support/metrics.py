"""Reading an in-process gateway's metrics (a `GatewayMetrics` registry) in a test."""

from __future__ import annotations

from gateway.metrics import GatewayMetrics


def sample(metrics: GatewayMetrics, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample's value (of the series with `labels`), 0 when the metric has none yet."""
    return metrics.registry.get_sample_value(name, labels) or 0.0
