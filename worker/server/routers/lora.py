"""vLLM's runtime LoRA API: `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`.

Mounted only with --allow-runtime-lora-updating (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True):
the body names a path on the worker's filesystem. Same bodies, answers and errors as vLLM.
A data-parallel worker loads and unloads on every rank, in order (each has its own slots), so
every rank serves the same adapters; a bad path fails on the first, before any rank changed.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from cachekey.openai.errors import APIError
from cachekey.openai.validation import MISSING_PARAMETER
from worker.server.app_state import all_ranks

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class LoadLoRAAdapterRequest(_Body):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # replace an adapter of that name


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = ""
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    name = body.lora_name
    for rank in all_ranks(raw):
        await rank.engine.add_lora(name, body.lora_path, body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    if not body.lora_name:
        # vLLM's words; adapters are unloaded by name here (lora_int_id is not exposed).
        raise APIError(
            400,
            "either 'lora_name' and 'lora_int_id' needs to be provided.",
            param="lora_name",
            code=MISSING_PARAMETER,
        )
    for rank in all_ranks(raw):
        await rank.engine.remove_lora(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
