"""Which replicas may serve a request: those serving its model, or the LoRA adapter it names."""

from __future__ import annotations

from cachekey.validation_errors import MISSING_PARAMETER
from gateway.errors import GatewayError
from gateway.fleet.replica import Replica
from gateway.routing.adapters import serves_adapter
from gateway.state import GatewayState


def candidates_for(state: GatewayState, model: str | None) -> tuple[list[Replica], str | None]:
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
        everyone = state.replicas.replicas.values()
        known = sorted({r.model for r in everyone if r.model})
        adapters = sorted({a for r in everyone if r.lora is not None for a in r.lora.adapters})
        if model not in known and model not in adapters:
            raise GatewayError(
                404,
                f"The model `{model}` does not exist. Served models: "
                + ", ".join(f"`{m}`" for m in known + adapters),
                param="model",
                code="model_not_found",
            )
        return serving, None
    served = {r.model for r in candidates}
    if len(served) > 1:
        raise GatewayError(
            400,
            "`model` is required: this gateway serves "
            + ", ".join(f"`{m}`" for m in sorted(m for m in served if m)),
            param="model",
            code=MISSING_PARAMETER,
        )
    return candidates, None
