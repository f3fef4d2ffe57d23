"""Thin routes: the OpenAI API, health, metrics, kvgate info/assets, the KV snapshot, debug."""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING

import msgspec
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from worker.engine.llm_engine import CachedBlock
from worker.server.errors import APIError, error_body
from worker.server.metrics import CONTENT_TYPE
from worker.server.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from worker.server.app import AppState

_json = msgspec.json.Encoder()


def attach_routes(app: FastAPI, state: AppState) -> None:
    created = int(time.time())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await state.chat.create(raw, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await state.completion.create(raw, body)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": created,
            "owned_by": "kvgate",
            "root": state.model_path,
            "max_model_len": state.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        h = state.engine.health()
        if h.ok:
            return Response(status_code=200)
        body = error_body(f"engine unhealthy: {h.reason}", 503, code="engine_dead")
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/kvgate/info")
    async def info() -> dict:
        return state.info

    @app.get("/kvgate/assets")
    async def assets() -> Response:
        files = state.engine.engine.assets.files
        encoded = {name: base64.b64encode(data).decode() for name, data in files.items()}
        return Response(_json.encode({"files": encoded}), media_type="application/json")

    @app.get("/kv/snapshot")
    async def snapshot() -> Response:
        snap = await state.engine.snapshot()
        payload = {
            "instance_id": state.instance_id,
            "seq": snap.seq,
            "block_size": state.info["block_size"],
            "blocks": [_block_json(b) for b in snap.blocks],  # parents first, every copy
        }
        return Response(_json.encode(payload), media_type="application/json")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        return {"reset": await state.engine.reset_prefix_cache()}

    if state.config.enable_fault_injection:

        @app.post("/debug/fault")
        async def fault(kind: str = Query(...), count: int = Query(1)) -> dict:
            try:
                state.engine.inject_fault(kind, count)
            except ValueError as e:
                raise APIError(str(e), 400, param="kind") from None
            return {"injected": kind}


def _block_json(block: CachedBlock) -> dict:
    return {
        "key": block.key.hex(),
        "parent": block.parent.hex() if block.parent is not None else None,
        "token_ids": list(block.token_ids),
        "extra_keys": [e if isinstance(e, str) else list(e) for e in block.extra_keys],
    }
