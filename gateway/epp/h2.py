"""HTTP/2 (RFC 9113), the server side a gRPC client needs, on the event loop's own socket callbacks.

Why not grpc.aio: its server hands every message across three threads (gRPC's I/O thread, its
completion-queue poller, the event loop), and behind Envoy those hand-offs cost more than the
routing decision itself (docs/benchmarks.md, "Behind a real Envoy"). Here a frame is parsed in
`data_received` and the answers a message produced go out in one write in the next iteration.

What is implemented: the preface and SETTINGS, HEADERS and CONTINUATION (HPACK), DATA with flow
control both ways, WINDOW_UPDATE, PING, RST_STREAM and GOAWAY both ways. PRIORITY frames are
ignored. A malformed frame, a PUSH_PROMISE, a window overrun or a header block that does not
decode is a connection error: GOAWAY, then the connection is closed. No h2c upgrade: gRPC
clients speak HTTP/2 from the first byte. The wire format: gateway/epp/h2_wire.py; the frames a
client sends and this server's limits: gateway/epp/h2_frames.py; a stream: gateway/epp/h2_stream.py.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable

from .h2_frames import (
    CONNECTION_WINDOW,
    FRAME_BYTES,
    MAX_HEADER_LIST,
    MAX_STREAMS,
    MAX_UNREAD,
    FramesIn,
)
from .h2_stream import STREAM_WINDOW, Stream
from .h2_wire import (
    ENHANCE_YOUR_CALM,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADER,
    INITIAL_WINDOW_SIZE,
    INTERNAL_ERROR,
    MAX_CONCURRENT_STREAMS,
    MAX_HEADER_LIST_SIZE,
    MAX_WINDOW,
    NO_ERROR,
    PREFACE,
    PROTOCOL_ERROR,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    H2Error,
    frame,
)

log = logging.getLogger(__name__)


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
        self._buf = bytearray()  # a partial frame
        self._preface = False
        self._out: list[bytes] = []
        self._closed = asyncio.Event()
        self.frames_in = FramesIn(self)  # the frames the client sends (h2_frames.py)

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
            self.drop(s)

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
                self.frames_in.on_frame(head & 0xFF, flags, stream_id & MAX_WINDOW, payload)
            if pos < n:
                self._buf += data[pos:]
        except H2Error as e:
            self._fail(e.code, str(e))
        except Exception:  # a bug here must not take the process down: end this connection
            log.exception("ext_proc connection: unexpected error; closing it")
            self._fail(INTERNAL_ERROR, "internal error")

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

    def drop(self, s: Stream) -> None:
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
