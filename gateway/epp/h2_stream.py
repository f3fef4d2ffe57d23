"""One HTTP/2 stream of gateway/epp/h2.py: the request's DATA as it comes (the stream's window
given back as it is read), the answer as the windows let it out."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Protocol

from .h2_wire import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    HEADERS,
    PROTOCOL_ERROR,
    WINDOW_UPDATE,
    H2Error,
    frame,
)


class Connection(Protocol):
    """What a stream needs of its connection (gateway/epp/h2.py's H2Connection)."""

    loop: asyncio.AbstractEventLoop
    peer_window: int  # the client's initial stream window
    send_window: int  # the connection's window for what we send
    peer_frame_bytes: int
    paused: bool  # the transport's buffer is full

    def write(self, data: bytes) -> None: ...

    def stream_ended(self, s: Stream) -> None: ...


# Per stream, what a client may send before we read it: bounds a stream nobody reads.
STREAM_WINDOW = 1 << 20


class Stream:
    """One request: its headers, the request's DATA as it comes, the answer as it goes out."""

    __slots__ = (
        "_chunks",
        "_drained",
        "_out",
        "_out_end",
        "_recv_window",
        "_trailers",
        "_unacked",
        "_waiter",
        "conn",
        "ended",
        "headers",
        "id",
        "on_reset",
        "reset",
        "sent_end",
        "window",
    )  # fmt: skip

    def __init__(self, conn: Connection, stream_id: int, headers: dict[str, str]) -> None:
        self.conn, self.id, self.headers = conn, stream_id, headers
        self.ended = False  # the client ended its side (END_STREAM)
        self.reset = False  # either side reset the stream, or the connection went
        self.sent_end = False  # our END_STREAM is queued
        self.on_reset: Callable[[], object] | None = None
        self.window = conn.peer_window  # what we may send (the client's window for us)
        self._chunks: deque[bytes] = deque()
        self._waiter: asyncio.Future | None = None
        self._recv_window = STREAM_WINDOW  # what the client may still send
        self._unacked = 0  # bytes read and not yet given back with WINDOW_UPDATE
        self._out: deque[memoryview] = deque()  # DATA waiting for window
        self._out_end = False
        self._trailers: bytes | None = None  # HEADERS that follow the waiting DATA
        self._drained: asyncio.Future | None = None

    # ---- in ---------------------------------------------------------------------------------

    def received(self, frame_bytes: int, body: bytes, end: bool) -> None:
        """A DATA frame of `frame_bytes` (padding included) carrying `body`."""
        if self.ended:
            raise H2Error(PROTOCOL_ERROR, "DATA after END_STREAM")
        self._recv_window -= frame_bytes
        if self._recv_window < 0:
            raise H2Error(FLOW_CONTROL_ERROR, "a stream window was overrun")
        self._unacked += frame_bytes - len(body)  # padding is never read: given back with it
        if body:
            self._chunks.append(body)
        self.ended = end
        self._wake()

    def end_received(self) -> None:
        """The client's trailers: its side ends."""
        self.ended = True
        self._wake()

    async def read(self) -> bytes | None:
        """The next DATA payload; None once the client ended its side or the stream is reset."""
        while not self._chunks:
            if self.ended or self.reset:
                return None
            self._waiter = self.conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = self._chunks.popleft()
        self._unacked += len(chunk)
        if self._unacked >= STREAM_WINDOW // 2 and not (self.ended or self.reset):
            self.conn.write(frame(WINDOW_UPDATE, 0, self.id, self._unacked.to_bytes(4, "big")))
            self._recv_window += self._unacked
            self._unacked = 0
        return chunk

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ---- out --------------------------------------------------------------------------------

    def send_headers(self, block: bytes, end: bool = False) -> None:
        """A header block (HPACK-encoded by the caller), after any DATA still waiting."""
        if self.reset or self.sent_end:
            return
        self.sent_end = end
        if self._out:
            self._trailers = block
        else:
            self._write_headers(block, end)

    def send_data(self, data: bytes, end: bool = False) -> None:
        """DATA as the windows allow; the rest waits for WINDOW_UPDATE (`drain()`)."""
        if self.reset or self.sent_end:
            return
        self._out.append(memoryview(data))
        self._out_end = self.sent_end = end
        self.pump()

    @property
    def blocked(self) -> bool:
        return bool(self._out) or self.conn.paused

    async def drain(self) -> None:
        """Until the waiting DATA is out and the transport takes more (or the stream is gone)."""
        while self.blocked and not self.reset:
            self._drained = self.conn.loop.create_future()
            try:
                await self._drained
            finally:
                self._drained = None

    def pump(self) -> None:
        """Send as much of the waiting DATA as the stream's and the connection's windows allow,
        then the trailers."""
        conn, out = self.conn, self._out
        while out:
            head = out[0]
            n = min(len(head), self.window, conn.send_window, conn.peer_frame_bytes)
            if n <= 0 and len(head):
                return  # until WINDOW_UPDATE
            last = n == len(head) and len(out) == 1
            flags = END_STREAM if last and self._out_end and self._trailers is None else 0
            conn.write(frame(DATA, flags, self.id, bytes(head[:n])))
            self.window -= n
            conn.send_window -= n
            if n == len(head):
                out.popleft()
            else:
                out[0] = head[n:]
        if self._trailers is not None:
            block, self._trailers = self._trailers, None
            self._write_headers(block, True)
        elif self._out_end:
            self._out_end = False
            conn.stream_ended(self)
        self.wake_writer()

    def _write_headers(self, block: bytes, end: bool) -> None:
        n = self.conn.peer_frame_bytes  # a longer block goes on in CONTINUATION frames
        pieces = [block[i : i + n] for i in range(0, len(block), n)] or [b""]
        for i, piece in enumerate(pieces):
            flags = END_HEADERS if i == len(pieces) - 1 else 0
            if i == 0:
                self.conn.write(frame(HEADERS, flags | (END_STREAM if end else 0), self.id, piece))
            else:
                self.conn.write(frame(CONTINUATION, flags, self.id, piece))
        if end:
            self.conn.stream_ended(self)

    def wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def gone(self) -> None:
        """Reset by the client, or the connection lost: reading ends, nothing more goes out,
        and the handler is told (`on_reset`)."""
        self.reset = True
        self._out.clear()
        self._wake()
        self.wake_writer()
        if self.on_reset is not None:
            self.on_reset()
