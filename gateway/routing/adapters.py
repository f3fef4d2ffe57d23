"""LoRA adapters behind the gateway: which replicas serve a `model` that names one, and what it
costs a replica to run it (adapter affinity).

A replica serves an adapter it lists: kvgate workers list theirs in /kvgate/info (`lora`), plain
vLLM workers in /v1/models (entries with a `parent`), both polled. A replica runs an adapter at
once when the adapter is resident (in one of its `max_loras` slots; for vLLM, named by
`vllm:lora_requests_info`); otherwise it must load it, into a free slot or in place of another
adapter. Between polls the gateway counts an adapter it has just sent a replica as resident
there, for `--speculative-ttl` seconds, so a burst for a new adapter follows the first request.
The miss is scored as the Gateway API inference extension's LoRA affinity scorer does: resident
best, a free slot next, a full replica last.
"""

from __future__ import annotations

from gateway.fleet.replica import Replica

RESIDENT, ROOM, FULL = 0.0, 0.5, 1.0


def serves_adapter(rep: Replica, model: str) -> bool:
    return rep.lora is not None and model in rep.lora.adapters


def adapter_miss(rep: Replica, name: str, now: float, ttl: float) -> float:
    """0 when `name` is resident on `rep` (or was just sent there), 0.5 when a slot is free,
    1 when loading it evicts another adapter."""
    lora = rep.lora
    if lora is None:
        return FULL
    recent = {n for n, at in rep.lora_routed.items() if now - at < ttl}
    if name in recent or name in lora.resident:
        return RESIDENT
    return ROOM if len(recent.union(lora.resident)) < lora.max_loras else FULL


def note_routed(rep: Replica, name: str, now: float, ttl: float) -> None:
    """The gateway sent `rep` a request for adapter `name` (forget what has expired)."""
    routed = rep.lora_routed
    for n in [n for n, at in routed.items() if now - at >= ttl]:
        del routed[n]
    routed[name] = now
