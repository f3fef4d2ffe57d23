"""The OpenAI API: chat completions, completions, the model list."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from worker.server.app_state import worker_state
from worker.server.protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
    return await worker_state(raw).chat.create(raw, body)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request) -> Response:
    return await worker_state(raw).completion.create(raw, body)


@router.get("/v1/models")
async def models(raw: Request) -> dict:
    state = worker_state(raw)
    info = state.info
    card = {
        "id": info.model,
        "object": "model",
        "created": state.created,
        "owned_by": "kvgate",
        "root": info.model_path,
        "parent": None,
        "max_model_len": info.max_model_len,
    }
    lora = state.engine.stats().lora
    adapters = [  # vLLM's cards: the adapter's path as root, the base model as parent
        {**card, "id": name, "root": path, "parent": info.model, "max_model_len": None}
        for name, path in (lora.adapters if lora is not None else ())
    ]
    return {"object": "list", "data": [card, *adapters]}
