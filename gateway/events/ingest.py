"""Decode, hash and apply one KV-event batch to the index, on the one ingestion thread.

Only calls the index; the subscriber (gateway/events/subscriber.py) owns ordering, gaps and metrics.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from cachekey.events import DecodeError, decode_batch
from cachekey.keys import HashNamespace
from gateway.index.block_index import BlockIndex
from gateway.names import ReplicaId

log = logging.getLogger(__name__)

# One thread for every subscriber: ingestion is GIL-bound, so more threads would only contend.
INGEST = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-ingest")


class Ingested(NamedTuple):
    errors: list[str]  # a reason per malformed batch, event or field skipped
    applied: int  # events applied
    unknown_parents: int = 0  # stored blocks skipped: their parent is not in the index
    stamped_at: float | None = None  # the batch's `ts`: when the worker published it (epoch s)
    cpu_seconds: float = 0.0  # the ingestion thread's CPU time on it


def ingest_batch(
    index: BlockIndex,
    replica: ReplicaId,
    ns: HashNamespace,
    rank: int | None,
    seq: int,
    payload: bytes,
) -> Ingested:
    """What applying one batch of `replica`'s stream did, and the CPU time it took; never
    raises.

    `rank` is the data-parallel rank the stream belongs to: a batch naming another rank is
    skipped whole, never merged."""
    t0 = time.thread_time()
    done = _ingest(index, replica, ns, rank, seq, payload)
    return done._replace(cpu_seconds=time.thread_time() - t0)


def _ingest(
    index: BlockIndex,
    replica: ReplicaId,
    ns: HashNamespace,
    rank: int | None,
    seq: int,
    payload: bytes,
) -> Ingested:
    try:
        batch = decode_batch(payload)
    except DecodeError as e:
        return Ingested([e.reason], 0)
    if rank is not None and batch.data_parallel_rank not in (None, rank):
        return Ingested(["wrong_data_parallel_rank"], 0)
    before_parent, before_errors = index.skipped_unknown_parent, index.errors.copy()
    try:
        applied = index.apply(replica, ns, batch.events)
    except Exception:  # a bug, not bad input: keep the replica's index and say so
        log.exception("%s: applying batch %d failed", replica, seq)
        return Ingested([*batch.errors, "internal"], 0)
    errors = list(batch.errors)
    for reason, n in (index.errors - before_errors).items():
        errors += [reason] * n
    unknown = index.skipped_unknown_parent - before_parent
    return Ingested(errors, applied, unknown, batch.ts or None)
