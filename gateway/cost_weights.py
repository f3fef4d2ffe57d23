"""The weights of cache_aware's cost terms beyond its time estimate (`--*-weight`; docs/gateway.md),
a part of GatewayConfig."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate_cli.flags import option


@dataclass(slots=True)
class CostWeights:
    """Weights of the cache_aware cost's terms beyond the time estimate (docs/gateway.md)."""

    recent: float = option(
        0.05,
        "per token of uncached prefill routed to the replica lately (decayed): spreads new "
        "prefixes over the replicas' caches",
        name="--recent-weight",
    )
    busy: float = option(
        0.5,
        "prefill time charged to a prefix's holder, per request it serves that shares the "
        "prefix beyond 2, in the tokens it holds of the request: a hot prefix's busy holders "
        "lose to a replica that recomputes it, so the prefix gets another holder, while "
        "distinct tenants stay on their holders (0: off)",
        name="--busy-weight",
    )
    evict: float = option(
        1.0,
        "prefill time charged per cached token a request's uncached prompt pushes out of a "
        "full cache, which a later request may recompute (0: off)",
        name="--evict-weight",
    )
    lora: float = option(
        32.0,
        "prompt blocks of prefill time charged to a request for a LoRA adapter on a replica "
        "that must load it by evicting another; half of it when a slot is free, 0 when the "
        "adapter is resident",
        name="--lora-weight",
    )

    def __post_init__(self) -> None:
        for name in ("recent", "busy", "evict", "lora"):
            if getattr(self, name) < 0:
                raise ValueError(f"weight {name} must be >= 0")
