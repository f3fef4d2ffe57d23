"""Reading an in-process gateway's metrics (a `GatewayMetrics` registry) in a test."""

from __future__ import annotations

from gateway.metrics import GatewayMetrics


def sample(metrics: GatewayMetrics, name: str) -> float:
    """One sample's value, 0 when the metric has none yet."""
    return metrics.registry.get_sample_value(name) or 0.0
