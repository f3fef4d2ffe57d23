"""RequestStream: the outputs of one API request's engine requests, read by its handler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from worker.engine.llm_engine import RequestOutput

# (request ids to forget, those of them to abort): AsyncEngine.release.
Release = Callable[[Sequence[str], Sequence[str]], None]


class RequestStream:
    """Outputs of the engine requests of one API request, in arrival order.

    The engine thread puts each RequestOutput (or the exception that failed the engine) on the
    sink; the handler iterates and must `close()` the stream when done.
    """

    def __init__(self, release: Release, request_ids: Sequence[str], sink: asyncio.Queue):
        self._release = release
        self._sink = sink
        self.request_ids = list(request_ids)
        self._unfinished = set(request_ids)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self._unfinished:
            item = await self._sink.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self._unfinished.discard(item.request_id)
            yield item

    def close(self) -> None:
        """Forget the requests; abort those not finished (client gone, error, cancellation)."""
        self._release(self.request_ids, sorted(self._unfinished))
        self._unfinished.clear()
