"""Which replicas may serve a request: those serving its model, or the LoRA adapter it names,
within the endpoint subset an EPP's proxy may name."""

from __future__ import annotations

from collections.abc import Collection

from cachekey.keys import HashNamespace
from cachekey.openai.errors import APIError
from cachekey.openai.validation import MISSING_PARAMETER
from gateway.fleet.replica import Replica
from gateway.names import ReplicaId
from gateway.routing.adapters import serves_adapter
from gateway.routing.services import RouteServices


def candidates_for(state: RouteServices, model: str | None) -> tuple[list[Replica], str | None]:
    """The available replicas serving `model`, and the LoRA adapter it names if it names one
    (404 for a model no known worker serves)."""
    candidates = state.replicas.available()
    if model:
        serving = [r for r in candidates if r.model == model]
        if serving or not candidates:
            return serving, None
        adapter = [r for r in candidates if serves_adapter(r, model)]
        if adapter:
            return adapter, model
        everyone = state.replicas
        known = sorted({r.model for r in everyone if r.model})
        adapters = sorted({a for r in everyone if r.lora is not None for a in r.lora.adapters})
        if model not in known and model not in adapters:
            raise APIError(
                404,
                f"The model `{model}` does not exist. Served models: "
                + ", ".join(f"`{m}`" for m in known + adapters),
                param="model",
                code="model_not_found",
            )
        return serving, None
    served = {r.model for r in candidates}
    if len(served) > 1:
        raise APIError(
            400,
            "`model` is required: this gateway serves "
            + ", ".join(f"`{m}`" for m in sorted(m for m in served if m)),
            param="model",
            code=MISSING_PARAMETER,
        )
    return candidates, None


def routable(
    state: RouteServices, model: str | None, subset: Collection[ReplicaId] | None
) -> tuple[list[Replica], str | None, HashNamespace]:
    """`candidates_for`, within `subset` when one is given, and the hash namespace they share
    (503 when none is available)."""
    candidates, lora_name = candidates_for(state, model)
    if subset is not None:
        candidates = [r for r in candidates if r.id in subset]
    ns = namespace_for(candidates)
    if (not candidates or ns is None) and not state.replicas.started:
        raise APIError(
            503,
            "starting: this gateway has not polled its workers yet; retry in a second",
            code="starting",
            headers={"retry-after": "1"},
        )
    if not candidates or ns is None:
        within = " in the proxy's endpoint subset" if subset is not None else ""
        raise APIError(
            503,
            f"no healthy worker{f' for model `{model}`' if model else ''}{within}: "
            + state.replicas.describe(model),
            code="no_healthy_worker",
        )
    return candidates, lora_name, ns


def namespace_for(candidates: list[Replica]) -> HashNamespace | None:
    """The hash namespace of the parity-consistent replicas (they all agree on it)."""
    for r in candidates:
        if r.parity_ok and r.namespace is not None:
            return r.namespace
    return None
