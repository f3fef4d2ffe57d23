"""A lean HTTP/1.1 client for the request path: pooled keep-alive connections to one worker.

The gateway sends one kind of request on its hot path, a JSON POST to a worker it knows. httpx
spent most of the gateway's CPU per proxied request (profiled, docs/benchmarks.md), so this
path uses asyncio connections with httptools' parser (already uvicorn's). Control traffic
(polls, snapshots, assets) stays on httpx.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

_PAUSE_BYTES = 1 << 20  # stop reading a stream the client does not drain past this much


class UpstreamError(Exception):
    """The worker could not be reached, or the connection broke before the answer ended."""


class UpstreamTimeout(UpstreamError):
    """No data from the worker for the read timeout."""


class UpstreamResponse:
    """A worker's answer: status and headers at once, then the body read or iterated once."""

    def __init__(self, conn: _Connection) -> None:
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

    def close(self) -> None:
        """Hand the connection back when the answer ended cleanly, else drop it."""
        if self._closed:
            return
        self._closed = True
        self._conn.finished(self.complete and self._error is None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request on it at a time."""

    def __init__(self, pool: UpstreamPool) -> None:
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
        self.pool._forget(self)
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
            self.pool._put(self)
        else:
            self.lost = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()


@dataclass(frozen=True, slots=True)
class Fetched:
    """A whole answer to a GET: its status and body (the pollers' documents)."""

    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class UpstreamPool:
    """Keep-alive connections to one worker base URL (http or https)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
        max_idle: int = 64,
        authorization: str | None = None,
    ) -> None:
        self.url = url
        u = urlsplit(url)
        self.https = u.scheme == "https"
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if self.https else 80)
        self.base_path = u.path.rstrip("/").encode()
        self._host_header = u.netloc.encode()
        # The worker token (docs/security.md), on every request to this worker.
        self._auth = b"Authorization: %s\r\n" % authorization.encode() if authorization else b""
        self._ssl = (ssl_context or ssl.create_default_context()) if self.https else None
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    async def post(self, path: str, body: bytes, extra_headers: bytes = b"") -> UpstreamResponse:
        """POST a JSON body; returns once the status line and headers are in."""
        head = (
            b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%s%s\r\n"
            % (
                self.base_path,
                path.encode(),
                self._host_header,
                len(body),
                self._auth,
                extra_headers,
            )
        )
        return await self._request(head, body)

    async def get(self, path: str) -> UpstreamResponse:
        """GET `path` (the pollers' /health, /metrics, /kvgate/info) on a kept-alive connection."""
        head = b"GET %s%s HTTP/1.1\r\nHost: %s\r\n%s\r\n" % (
            self.base_path,
            path.encode(),
            self._host_header,
            self._auth,
        )
        return await self._request(head, b"")

    async def fetch(self, path: str) -> Fetched:
        """GET `path` and read the whole answer."""
        resp = await self.get(path)
        return Fetched(resp.status, await resp.read())

    async def _request(self, head: bytes, body: bytes) -> UpstreamResponse:
        while self._idle:
            conn = self._idle.pop()
            try:
                return await self._send(conn, head, body)
            except UpstreamTimeout:
                raise
            except UpstreamError:
                continue  # an idle connection the worker closed meanwhile: take the next one
        return await self._send(await self._connect(), head, body)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self._ssl
                ),
                self.connect_timeout,
            )
        except (OSError, TimeoutError) as e:
            raise UpstreamError(f"connect failed: {type(e).__name__}: {e}") from e
        self._open.add(conn)
        return conn

    async def _send(self, conn: _Connection, head: bytes, body: bytes) -> UpstreamResponse:
        assert conn.transport is not None
        if conn.lost or conn.transport.is_closing():
            # The worker closed it between the connect and now (a worker killed just after it
            # accepted): uvloop raises on a write to a closed transport. Nothing was sent.
            raise UpstreamError("connection closed before the request was sent")
        resp = conn.resp = UpstreamResponse(conn)
        if len(body) < 65536:
            conn.transport.write(head + body)
        else:
            conn.transport.writelines((head, body))
        try:
            while not resp._headers_done:
                await resp._wait(self.read_timeout)
        except BaseException:
            resp.close()  # mid-answer (or cancelled): the connection cannot be reused
            raise
        return resp

    def _put(self, conn: _Connection) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            self._forget(conn)
            if conn.transport is not None:
                conn.transport.close()

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    async def close(self) -> None:
        for conn in list(self._open):
            if conn.transport is not None:
                conn.transport.close()
        self._open.clear()
        self._idle.clear()
