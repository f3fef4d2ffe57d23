"""A small HTTP/1.1 server for the fleet: keep-alive, one request at a time per connection,
answers written whole or streamed (chunked), parsed with httptools (as uvicorn does).

Hundreds of replicas share one process, so each listening port costs one asyncio server and each
request a parse and a write: no ASGI layers, no per-request task.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

import httptools
import msgspec

from cachekey.openai.errors import error_body

_json = msgspec.json.Encoder()
_REASONS = {s.value: s.phrase for s in HTTPStatus}
MAX_BODY = 64 * 2**20  # a request body past this is refused (413)


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[bytes, bytes]
    body: bytes


@dataclass(slots=True, eq=False)
class Exchange:
    """One request and the way to answer it: `send` once, or `start` + `chunk`... + `end`."""

    request: Request
    conn: Connection
    oversize: bool = False  # its body was over MAX_BODY (and was not kept)
    started: bool = field(default=False, init=False)

    def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        head = _head(status, content_type, f"content-length: {len(body)}")
        self.conn.write(head + body)
        self.conn.done(self)

    def error(self, status: int, message: str, param: str | None = None) -> None:
        self.send(status, _json.encode(error_body(status, message, param=param)))

    def start(self, content_type: str = "text/event-stream") -> None:
        self.started = True
        self.conn.write(_head(200, content_type, "transfer-encoding: chunked"))

    def chunk(self, data: bytes) -> None:
        self.conn.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end(self) -> None:
        self.conn.write(b"0\r\n\r\n")
        self.conn.done(self)


def _head(status: int, content_type: str, length: str) -> bytes:
    return (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
        f"content-type: {content_type}\r\n{length}\r\n\r\n"
    ).encode("latin-1")


Handler = Callable[[Exchange], None]


class Connection(asyncio.Protocol):
    """Requests are answered in arrival order; a pipelined one waits for the one before."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._pending: deque[Exchange] = deque()
        self._current: Exchange | None = None
        self._close_after = False

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport) -> None:  # uvloop's transports are not asyncio's
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self.write(_head(400, "text/plain", "content-length: 0"))
            self.close()

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size = b"", {}, [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size <= MAX_BODY:
            self._body.append(body)

    def on_message_complete(self) -> None:
        parsed = httptools.parse_url(self._url)
        request = Request(
            self._parser.get_method().decode(),
            parsed.path.decode("latin-1"),
            (parsed.query or b"").decode("latin-1"),
            self._headers,
            b"".join(self._body),
        )
        ex = Exchange(request, self, oversize=self._size > MAX_BODY)
        if not self._parser.should_keep_alive():
            self._close_after = True
        self._pending.append(ex)
        self._run_next()

    # -- answering --------------------------------------------------------------------------

    def _run_next(self) -> None:
        if self._current is not None or not self._pending:
            return
        ex = self._current = self._pending.popleft()
        if ex.oversize:
            ex.error(413, f"request body over {MAX_BODY} bytes")
            return
        try:
            self._handler(ex)
        except Exception as e:  # a bug in a handler must not leave the client hanging
            if self._current is ex and not ex.started:
                ex.error(500, f"fleet handler failed: {type(e).__name__}: {e}")
            raise

    def write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def done(self, ex: Exchange) -> None:
        if self._current is not ex:
            return
        self._current = None
        if self._close_after and not self._pending:
            self.close()
            return
        self._run_next()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def serve(host: str, port: int, handler: Handler) -> asyncio.Server:
    """Listen on host:port (0: any free port) and answer every request with `handler`."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: Connection(handler), host, port, backlog=1024)
