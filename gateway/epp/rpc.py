"""gRPC over gateway/epp/h2.py: methods by path, length-prefixed messages, the status in trailers.

A method is an async generator `handler(requests, call)`: it reads the request messages (parsed
protobufs) from `requests` and yields the answers; `await call.abort(code, details)` ends the
call with that status. Unary methods read one request and yield one answer. A client that resets
its stream cancels the handler's task; `RpcServer.stop(grace)` sends GOAWAY, gives the calls in
flight `grace` seconds, then cancels them (status UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from google.protobuf.message import DecodeError

from .h2 import H2Connection, Stream

log = logging.getLogger(__name__)


class Status(enum.IntEnum):
    """gRPC status codes (the ones this server answers)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


class Abort(Exception):
    """Ends a call with `code` and `details` (raised by `Call.abort`)."""

    def __init__(self, code: Status, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Call:
    """What a method gets besides its requests."""

    __slots__ = ("stream",)

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    async def abort(self, code: Status, details: str) -> NoReturn:
        raise Abort(code, details)


@dataclass(frozen=True, slots=True)
class Method:
    parse: Callable[[bytes], Any]  # the request type's FromString
    handler: Callable[[AsyncIterator, Call], AsyncIterator]


# HPACK, no dynamic table: `:status: 200` (static entry 8) and `content-type: application/grpc`
# (a literal with the static name 31).
_RESPONSE_HEADERS = b"\x88\x0f\x10\x10application/grpc"


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman."""
    return b"\x00" + _length(name) + name + _length(value) + value


def _length(s: bytes) -> bytes:
    n = len(s)
    if n < 127:
        return bytes([n])
    out, n = bytearray([127]), n - 127
    while n >= 128:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def trailers(code: Status, details: str = "") -> bytes:
    block = _literal(b"grpc-status", str(int(code)).encode())
    if details:  # percent-encoded, as gRPC's HTTP/2 mapping says; bounded
        quoted = urllib.parse.quote(details[:1000], safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")
        block += _literal(b"grpc-message", quoted.encode())
    return block


_OK_TRAILERS = trailers(Status.OK)


class RpcServer:
    def __init__(self, methods: dict[str, Method], max_message_bytes: int) -> None:
        self.methods = methods
        self.max_message_bytes = max_message_bytes
        self._server: asyncio.Server | None = None
        self._connections: set[H2Connection] = set()
        self._calls: set[asyncio.Task] = set()

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
        """Binds (OSError when the port is taken) and serves."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, host, port, ssl=tls)

    def _connection(self) -> H2Connection:
        conn = H2Connection(self._on_stream)
        self._connections.add(conn)
        asyncio.get_running_loop().create_task(self._forget(conn))
        return conn

    async def _forget(self, conn: H2Connection) -> None:
        await conn.wait_closed()
        self._connections.discard(conn)

    def _on_stream(self, stream: Stream) -> None:
        method = self.methods.get(stream.headers.get(":path", ""))
        if method is None:
            path = stream.headers.get(":path", "")
            stream.send_headers(_RESPONSE_HEADERS + trailers(Status.UNIMPLEMENTED, path), True)
            return
        task = asyncio.get_running_loop().create_task(self._serve(stream, method))
        stream.on_reset = task.cancel
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _serve(self, stream: Stream, method: Method) -> None:
        started = False
        try:
            requests = self._requests(stream, method.parse)
            async with contextlib.aclosing(method.handler(requests, Call(stream))) as answers:
                async for msg in answers:
                    data = msg.SerializeToString()
                    if not started:
                        started = True
                        stream.send_headers(_RESPONSE_HEADERS)
                    stream.send_data(b"\0" + len(data).to_bytes(4, "big") + data)
                    if stream.blocked:
                        await stream.drain()
            end = _OK_TRAILERS
        except Abort as e:
            end = trailers(e.code, e.details)
        except asyncio.CancelledError:
            if stream.reset:
                return  # the client went away: nobody to answer
            end = trailers(Status.UNAVAILABLE, "the endpoint picker is shutting down")
        except Exception as e:
            log.exception("ext_proc: %s failed", stream.headers.get(":path"))
            end = trailers(Status.UNKNOWN, f"unexpected {type(e).__name__}")
        stream.send_headers(end if started else _RESPONSE_HEADERS + end, end=True)

    async def _requests(self, stream: Stream, parse: Callable[[bytes], Any]) -> AsyncIterator:
        """The request messages: a 5-byte prefix (compressed?, length), then the message."""
        pending = bytearray()
        while (chunk := await stream.read()) is not None:
            data: bytes | bytearray = chunk
            if pending:
                pending += chunk
                data = pending
            pos, n = 0, len(data)
            while n - pos >= 5:
                size = int.from_bytes(data[pos + 1 : pos + 5], "big")
                if data[pos]:
                    raise Abort(Status.UNIMPLEMENTED, "compressed messages are not accepted")
                if size > self.max_message_bytes:
                    msg = f"a message of {size} bytes > limit {self.max_message_bytes}"
                    raise Abort(Status.RESOURCE_EXHAUSTED, msg)
                if n - pos - 5 < size:
                    break
                try:
                    request = parse(bytes(data[pos + 5 : pos + 5 + size]))
                except DecodeError:
                    raise Abort(Status.INTERNAL, "a request message does not parse") from None
                pos += 5 + size
                yield request
            if data is pending:
                del pending[:pos]
            else:
                pending += data[pos:]
        if pending:
            raise Abort(Status.INTERNAL, "the request ended inside a message")

    async def stop(self, grace: float) -> None:
        """No new connections or calls; those in flight get `grace` seconds, then are
        cancelled; then the connections close."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.goaway()
        if self._calls:
            await asyncio.wait(set(self._calls), timeout=grace)
        for task in list(self._calls):
            task.cancel()
        if self._calls:
            await asyncio.wait(set(self._calls), timeout=5.0)
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await self._server.wait_closed()
