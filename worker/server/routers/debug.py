"""`POST /debug/fault`: fault injection for tests, mounted only with --enable-fault-injection."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from cachekey.openai.errors import INVALID_VALUE, UNKNOWN_URL, APIError
from worker.server.app_state import rank_state

router = APIRouter()


@router.post("/debug/fault")
async def fault(
    raw: Request, kind: str = Query(...), count: int = Query(1), marker: str | None = Query(None)
) -> dict:
    faults = rank_state(raw).faults  # the engine X-data-parallel-rank names
    if faults is None:
        raise APIError(
            404, "fault injection is disabled (--enable-fault-injection)", code=UNKNOWN_URL
        )
    try:
        faults.inject(kind, count, marker)
    except ValueError as e:
        raise APIError(400, str(e), param="kind", code=INVALID_VALUE) from None
    return {"injected": kind}
