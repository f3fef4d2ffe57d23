"""The OpenAI embeddings endpoint."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from worker.server.app_state import worker_state
from worker.server.embedding_protocol import EmbeddingRequest

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
    return await worker_state(raw).embedding.create(raw, body)
