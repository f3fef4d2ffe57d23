"""What a gateway reads: `/kvgate/info`, `/kvgate/assets`, `/kv/snapshot` (cachekey.documents)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from cachekey.documents import Snapshot, SnapshotBlock, encode_document
from cachekey.openai.errors import INVALID_VALUE, APIError
from worker.engine.llm_engine import CachedBlock
from worker.server.app_state import all_ranks, current_info, worker_state

router = APIRouter()

_JSON = "application/json"


@router.get("/kvgate/info")
async def info(raw: Request) -> Response:
    return Response(encode_document(current_info(all_ranks(raw))), media_type=_JSON)


@router.get("/kvgate/assets")
async def assets(raw: Request) -> Response:
    return Response(encode_document(worker_state(raw).assets), media_type=_JSON)


@router.get("/kv/snapshot")
async def snapshot(raw: Request, rank: int | None = Query(None)) -> Response:
    """Every cached block of one engine: the first, or the data-parallel `rank` given."""
    state = worker_state(raw)
    if rank is not None:
        state = next((r for r in all_ranks(raw) if (r.rank or 0) == rank), None)
        if state is None:
            msg = f"this worker serves no data-parallel rank {rank}"
            raise APIError(404, msg, param="rank", code=INVALID_VALUE)
    snap = await state.engine.snapshot()
    doc = Snapshot(
        instance_id=state.info.instance_id,
        seq=snap.seq,
        block_size=state.info.block_size,
        blocks=[_snapshot_block(b) for b in snap.blocks],  # parents first, every copy
        host_blocks=[_snapshot_block(b) for b in snap.host_blocks],
    )
    return Response(encode_document(doc), media_type=_JSON)


def _snapshot_block(block: CachedBlock) -> SnapshotBlock:
    return SnapshotBlock(
        key=block.key.hex(),
        parent=block.parent.hex() if block.parent is not None else None,
        token_ids=list(block.token_ids),
        extra_keys=block.extra_keys,
    )
