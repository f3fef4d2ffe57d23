"""HTTP/2 (RFC 9113), the server side a gRPC client needs, on the event loop's own socket callbacks.

Why not grpc.aio: its server hands every message across three threads (gRPC's I/O thread, its
completion-queue poller, the event loop), and behind Envoy those hand-offs cost more than the
routing decision itself (docs/benchmarks.md, "Behind a real Envoy"). Here a frame is parsed in
`data_received` and the answers a message produced go out in one write in the next iteration.

What is implemented: the preface and SETTINGS, HEADERS and CONTINUATION (HPACK), DATA with flow
control both ways, WINDOW_UPDATE, PING, RST_STREAM and GOAWAY both ways. PRIORITY frames are
ignored. A malformed frame, a PUSH_PROMISE, a window overrun or a header block that does not
decode is a connection error: GOAWAY, then the connection is closed. No h2c upgrade: gRPC
clients speak HTTP/2 from the first byte. The wire format: gateway/epp/h2_wire.py; a stream:
gateway/epp/h2_stream.py.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable

from .h2_stream import STREAM_WINDOW, Stream
from .h2_wire import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADER,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    INTERNAL_ERROR,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE,
    MAX_WINDOW,
    NO_ERROR,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    H2Error,
    HeaderBlocks,
    frame,
    unpad,
)

log = logging.getLogger(__name__)

FRAME_BYTES = 16_384  # the largest frame we accept (the protocol's default; not raised)
CONNECTION_WINDOW = 16 << 20  # the connection's window is given back as frames arrive
MAX_STREAMS = 8192  # concurrent streams per connection; a proxy opens another connection past it
MAX_HEADER_LIST = 64 << 10
# Answers a client does not read: past this, while the transport is paused, the control frames
# it keeps sending (PING, SETTINGS) would be answered into memory without bound.
MAX_UNREAD = 4 << 20
# "Rapid reset" (CVE-2023-44487): a client that opens streams and resets them before they are
# answered makes the server start work it then throws away, without the concurrency bound ever
# applying. As Envoy does (premature resets), once a connection has opened RESET_FLOOR streams
# it is closed (GOAWAY ENHANCE_YOUR_CALM) when half of them or more were reset unanswered.
RESET_FLOOR = 200


class H2Connection(asyncio.Protocol):
    """One client connection; `on_stream(stream)` is called for each new request."""

    def __init__(self, on_stream: Callable[[Stream], None]) -> None:
        self.on_stream = on_stream
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Stream] = {}
        self.last_stream_id = 0
        self.peer_window = 65_535  # the client's initial stream window (its SETTINGS)
        self.send_window = 65_535  # the connection's
        self.peer_frame_bytes = 16_384
        self.paused = False  # the transport's buffer is full
        self.closing = False  # GOAWAY sent: no new streams
        self._blocks = HeaderBlocks(MAX_HEADER_LIST)
        self._buf = bytearray()  # a partial frame
        self._preface = False
        self._header_block: tuple[int, int, bytearray] | None = None  # (stream, flags, block)
        self._recv_window = CONNECTION_WINDOW
        self._out: list[bytes] = []
        self._closed = asyncio.Event()
        self._opened = 0  # streams the client opened
        self._early_resets = 0  # of them, reset by the client before our answer ended

    # ---- transport callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        settings = b"".join(
            struct.pack(">HI", k, v)
            for k, v in ((MAX_CONCURRENT_STREAMS, MAX_STREAMS),
                         (INITIAL_WINDOW_SIZE, STREAM_WINDOW),
                         (MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST))
        )  # fmt: skip
        grow = (CONNECTION_WINDOW - 65_535).to_bytes(4, "big")
        self.write(frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, grow))

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed.set()
        for s in list(self.streams.values()):
            self._drop(s)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        for s in list(self.streams.values()):
            s.wake_writer()

    def data_received(self, data: bytes) -> None:
        if self._buf:  # the rest of a frame that came before
            self._buf += data
            data = bytes(self._buf)
            self._buf.clear()
        try:
            pos, n = 0, len(data)
            if not self._preface:
                if n < len(PREFACE) and PREFACE.startswith(data):
                    self._buf += data
                    return
                if not data.startswith(PREFACE):
                    raise H2Error(PROTOCOL_ERROR, "not an HTTP/2 client preface")
                pos, self._preface = len(PREFACE), True
            while n - pos >= 9:
                head, flags, stream_id = HEADER.unpack_from(data, pos)
                length = head >> 8
                if length > FRAME_BYTES:
                    raise H2Error(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                if n - pos - 9 < length:
                    break
                payload = data[pos + 9 : pos + 9 + length]
                pos += 9 + length
                self._on_frame(head & 0xFF, flags, stream_id & MAX_WINDOW, payload)
            if pos < n:
                self._buf += data[pos:]
        except H2Error as e:
            self._fail(e.code, str(e))
        except Exception:  # a bug here must not take the process down: end this connection
            log.exception("ext_proc connection: unexpected error; closing it")
            self._fail(INTERNAL_ERROR, "internal error")

    # ---- frames in ------------------------------------------------------------------------

    def _on_frame(self, kind: int, flags: int, stream_id: int, p: bytes) -> None:
        if self._header_block is not None and kind != CONTINUATION:
            raise H2Error(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self._on_data(flags, stream_id, p)
        elif kind == HEADERS:
            if stream_id == 0:
                raise H2Error(PROTOCOL_ERROR, "HEADERS on stream 0")
            p = unpad(flags, p)
            if flags & PRIORITY_FLAG:
                p = p[5:]
            self._header_block = (stream_id, flags, bytearray(p))
            if flags & END_HEADERS:
                self._end_header_block()
        elif kind == CONTINUATION:
            if self._header_block is None or self._header_block[0] != stream_id:
                raise H2Error(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            self._header_block[2].extend(p)
            if len(self._header_block[2]) > MAX_HEADER_LIST:
                raise H2Error(COMPRESSION_ERROR, "header block too large")
            if flags & END_HEADERS:
                self._end_header_block()
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, p)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, p)
        elif kind == PING:
            if len(p) != 8 or stream_id:
                raise H2Error(FRAME_SIZE_ERROR, "PING is 8 bytes on stream 0")
            if not flags & ACK:
                self.write(frame(PING, ACK, 0, p))
        elif kind == RST_STREAM:
            if len(p) != 4 or not stream_id:
                raise H2Error(FRAME_SIZE_ERROR, "bad RST_STREAM")
            if (s := self.streams.get(stream_id)) is not None:
                self._drop(s)
                self._early_resets += 1
                if self._opened >= RESET_FLOOR and 2 * self._early_resets >= self._opened:
                    raise H2Error(ENHANCE_YOUR_CALM, "the client resets most streams it opens")
        elif kind == GOAWAY:
            self.closing = True  # the client opens no more streams here; those open go on
        elif kind == PUSH_PROMISE:
            raise H2Error(PROTOCOL_ERROR, "a client sent PUSH_PROMISE")
        # PRIORITY and unknown frame types are ignored (RFC 9113 5.5, 6.3)

    def _on_data(self, flags: int, stream_id: int, p: bytes) -> None:
        if stream_id == 0:
            raise H2Error(PROTOCOL_ERROR, "DATA on stream 0")
        self._recv_window -= len(p)
        if self._recv_window < 0:
            raise H2Error(FLOW_CONTROL_ERROR, "the connection window was overrun")
        if self._recv_window <= CONNECTION_WINDOW // 2:  # given back at once: streams bound it
            grow = CONNECTION_WINDOW - self._recv_window
            self.write(frame(WINDOW_UPDATE, 0, 0, grow.to_bytes(4, "big")))
            self._recv_window = CONNECTION_WINDOW
        s = self.streams.get(stream_id)
        if s is None:
            if stream_id > self.last_stream_id:
                raise H2Error(PROTOCOL_ERROR, "DATA on an idle stream")
            return  # a stream closed or reset a moment ago
        body = unpad(flags, p)
        s.received(len(p), body, bool(flags & END_STREAM))

    def _end_header_block(self) -> None:
        assert self._header_block is not None
        stream_id, flags, block = self._header_block
        self._header_block = None
        headers = self._blocks.decode(bytes(block))
        s = self.streams.get(stream_id)
        if s is not None:  # trailers: the client's side ends
            s.end_received()
            return
        if stream_id % 2 == 0:
            raise H2Error(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        if stream_id <= self.last_stream_id:
            return  # trailers of a stream that closed a moment ago
        self.last_stream_id = stream_id
        if self.closing or len(self.streams) >= MAX_STREAMS:
            self.write(frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
            return
        self._opened += 1
        s = self.streams[stream_id] = Stream(self, stream_id, headers)
        s.ended = bool(flags & END_STREAM)
        self.on_stream(s)

    def _on_settings(self, flags: int, stream_id: int, p: bytes) -> None:
        if stream_id:
            raise H2Error(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(p) % 6:
            raise H2Error(FRAME_SIZE_ERROR, "SETTINGS of a partial entry")
        for i in range(0, len(p), 6):
            key, value = struct.unpack_from(">HI", p, i)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2Error(FLOW_CONTROL_ERROR, "initial window too large")
                delta, self.peer_window = value - self.peer_window, value
                for s in self.streams.values():
                    s.window += delta
            elif key == MAX_FRAME_SIZE:
                if not 16_384 <= value < 1 << 24:
                    raise H2Error(PROTOCOL_ERROR, f"max frame size {value}")
                self.peer_frame_bytes = value
            # HEADER_TABLE_SIZE: our answers use no dynamic table; the rest limit the client.
        self.write(frame(SETTINGS, ACK, 0))
        for s in list(self.streams.values()):
            s.pump()

    def _on_window_update(self, stream_id: int, p: bytes) -> None:
        if len(p) != 4:
            raise H2Error(FRAME_SIZE_ERROR, "WINDOW_UPDATE is 4 bytes")
        grow = int.from_bytes(p, "big") & MAX_WINDOW
        if stream_id == 0:
            self.send_window += grow
            if grow == 0 or self.send_window > MAX_WINDOW:
                raise H2Error(FLOW_CONTROL_ERROR, "bad connection WINDOW_UPDATE")
            for s in list(self.streams.values()):
                s.pump()
        elif (s := self.streams.get(stream_id)) is not None:
            s.window += grow
            s.pump()

    # ---- frames out -----------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Queued, and written once per loop iteration: the answers a message produced go out
        in one system call."""
        if not self._out:
            self.loop.call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        t = self.transport
        if t is None or t.is_closing():
            return
        t.writelines(out)
        if self.paused and t.get_write_buffer_size() > MAX_UNREAD:
            self._fail(ENHANCE_YOUR_CALM, "the client reads none of its answers")

    def stream_ended(self, s: Stream) -> None:
        """Our END_STREAM is out: the stream closes; a client still sending is told to stop
        (RST_STREAM NO_ERROR, RFC 9113 8.1)."""
        if not s.ended:
            self.write(frame(RST_STREAM, 0, s.id, NO_ERROR.to_bytes(4, "big")))
        self.streams.pop(s.id, None)

    def _drop(self, s: Stream) -> None:
        """The stream is gone (reset by the client, or the connection lost)."""
        self.streams.pop(s.id, None)
        s.gone()

    def _fail(self, code: int, message: str) -> None:
        """A connection error: GOAWAY(code), then the connection closes (at once when the
        client reads nothing)."""
        t = self.transport
        if t is None or t.is_closing():
            return
        log.warning("ext_proc connection: %s; closing it (GOAWAY %d)", message, code)
        goaway = struct.pack(">II", self.last_stream_id, code) + message.encode()[:200]
        t.writelines([*self._out, frame(GOAWAY, 0, 0, goaway)])
        self._out = []
        if code == ENHANCE_YOUR_CALM:
            t.abort()
        else:
            t.close()

    # ---- shutdown ---------------------------------------------------------------------------

    def goaway(self) -> None:
        """No new streams (GOAWAY NO_ERROR); those open go on (RpcServer.stop closes the
        connection once its calls are done or cancelled)."""
        if not self.closing:
            self.closing = True
            self.write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream_id, NO_ERROR)))

    def close(self) -> None:
        self._flush()
        if self.transport is not None:
            self.transport.close()

    async def wait_closed(self) -> None:
        await self._closed.wait()
