"""RequestStream: the outputs of one API request's engine requests, read by its handler (which
stops early with `unless_gone` when the client disconnects)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from fastapi import Request

from worker.engine.llm_engine import RequestOutput

# (request ids to forget, those of them to abort): AsyncEngine.release.
Release = Callable[[Sequence[str], Sequence[str]], None]
T = TypeVar("T")


class RequestStream:
    """Outputs of the engine requests of one API request, in arrival order.

    The event loop puts each RequestOutput the core sends (or the exception that failed the
    engine) on the sink; the handler iterates and must `close()` the stream when done.
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

    def cut(self, exc: Exception) -> None:
        """End the stream with `exc` (a drain's deadline passed): its reader raises it."""
        self._sink.put_nowait(exc)

    def close(self) -> None:
        """Forget the requests; abort those not finished (client gone, error, cancellation)."""
        self._release(self.request_ids, sorted(self._unfinished))
        self._unfinished.clear()


async def _wait_disconnect(raw: Request) -> None:
    # After the body is read, the only message left on the ASGI channel is the disconnect.
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_gone(raw: Request, stream: RequestStream, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client disconnects first (the work is cancelled);
    the request's stream is closed either way."""
    done = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait((done, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not done.done():
            done.cancel()
        stream.close()
    if not done.done() or done.cancelled():
        return None
    return done.result()
