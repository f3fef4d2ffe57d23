"""One keep-alive connection to a worker (httptools parses its answers) and the answer read from
it, for UpstreamPool (pool.py), which opens, reuses and closes the connections."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol

import httptools

_PAUSE_BYTES = 1 << 20  # stop reading a stream the client does not drain past this much


class UpstreamError(Exception):
    """The worker could not be reached, or the connection broke before the answer ended."""


class UpstreamTimeout(UpstreamError):
    """No data from the worker for the read timeout."""


class UpstreamResponse:
    """A worker's answer: status and headers at once, then the body read or iterated once."""

    def __init__(self, conn: WorkerConnection) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}  # lower-cased names
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._headers_done = False
        self.complete = False
        self._error: Exception | None = None
        self._closed = False
        self._whole = False  # read() takes the whole body: no back-pressure

    @property
    def origin(self) -> str:
        return self._conn.pool.url

    @property
    def content_type(self) -> str:
        return self.headers.get(b"content-type", b"application/json").decode("latin-1")

    # -- fed by the connection ---------------------------------------------------------------

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _PAUSE_BYTES and not self._whole:
            self._conn.pause()
        self._wake()

    def _fail(self, exc: Exception) -> None:
        if not self.complete and self._error is None:
            self._error = exc
            self._wake()

    # -- read by the request path ------------------------------------------------------------

    async def _wait(self, timeout: float) -> None:
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout, self._fail, UpstreamTimeout(f"no data for {timeout:g}s"))
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self._error is not None:
            raise self._error

    async def read(self) -> bytes:
        """The whole body."""
        self._whole = True
        self._conn.resume()
        while not self.complete:
            await self._wait(self._conn.pool.read_timeout)
        body = b"".join(self._chunks)
        self._chunks.clear()
        self.close()
        return body

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (transfer encoding removed)."""
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                yield chunk
            if self.complete:
                return
            self._conn.resume()
            await self._wait(self._conn.pool.read_timeout)

    def abort(self, exc: Exception) -> None:
        """Fail the reader waiting on this answer with `exc` (a drain cutting the stream); the
        connection is dropped when the answer is closed."""
        self._fail(exc)

    def close(self) -> None:
        """Hand the connection back when the answer ended cleanly, else drop it."""
        if self._closed:
            return
        self._closed = True
        self._conn.finished(self.complete and self._error is None)


class ConnectionPool(Protocol):
    """What a connection and its answer use of their pool (upstream.UpstreamPool)."""

    url: str
    read_timeout: float

    def put_back(self, conn: WorkerConnection) -> None: ...

    def forget(self, conn: WorkerConnection) -> None: ...


class WorkerConnection(asyncio.Protocol):
    """One keep-alive connection; at most one request on it at a time."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: UpstreamResponse | None = None
        self.keep_alive = False
        self.lost = False
        self.paused = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._lose(UpstreamError(f"malformed HTTP response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(UpstreamError(f"connection closed: {exc or 'EOF'}"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.resp is not None:
            self.resp.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        if self.resp is not None:
            self.resp.status = self.parser.get_status_code()
            self.resp._headers_done = True
            self.resp._wake()

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._feed(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        if self.resp is not None:
            self.resp.complete = True
            self.resp._wake()

    # used by the pool and the response
    def _lose(self, exc: Exception) -> None:
        self.lost = True
        if self.resp is not None:
            self.resp._fail(exc)
        self.pool.forget(self)
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def finished(self, clean: bool) -> None:
        self.resp = None
        if clean and self.keep_alive and not self.lost:
            self.resume()
            self.pool.put_back(self)
        else:
            self.lost = True
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.close()
