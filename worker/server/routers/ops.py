"""Operations: health, Prometheus metrics, resetting the prefix cache."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cachekey.openai.errors import ENGINE_DEAD, error_body
from worker.server.app_state import all_ranks, worker_state
from worker.server.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health")
async def health(raw: Request) -> Response:
    """200 while every engine is healthy (vLLM's server fails as a whole, too)."""
    ranks = all_ranks(raw)
    for rank in ranks:
        h = rank.engine.health()
        if not h.ok:
            which = f" (data-parallel rank {rank.rank})" if len(ranks) > 1 else ""
            body = error_body(503, f"engine unhealthy{which}: {h.reason}", code=ENGINE_DEAD)
            return JSONResponse(body, status_code=503)
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    return Response(worker_state(raw).metrics.render(), media_type=CONTENT_TYPE)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw: Request) -> dict:
    done = [await rank.engine.reset_prefix_cache() for rank in all_ranks(raw)]
    return {"reset": all(done)}
