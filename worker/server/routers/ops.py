"""Operations: health, Prometheus metrics, resetting the prefix cache."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from worker.server.app_state import worker_state
from worker.server.errors import error_body
from worker.server.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health")
async def health(raw: Request) -> Response:
    h = worker_state(raw).engine.health()
    if h.ok:
        return Response(status_code=200)
    body = error_body(f"engine unhealthy: {h.reason}", 503, code="engine_dead")
    return JSONResponse(body, status_code=503)


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    return Response(worker_state(raw).metrics.render(), media_type=CONTENT_TYPE)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw: Request) -> dict:
    return {"reset": await worker_state(raw).engine.reset_prefix_cache()}
