"""HTTP/2 (RFC 9113), the server side a gRPC client needs, on the event loop's own socket callbacks.

Why not grpc.aio: its server hands every message across three threads (gRPC's I/O thread, its
completion-queue poller, the event loop), and behind Envoy those hand-offs cost more than the
routing decision itself (docs/benchmarks.md, "Behind a real Envoy"). Here a frame is parsed in
`data_received` and an answer written in the same loop iteration.

What is implemented: the preface and SETTINGS, HEADERS and CONTINUATION (HPACK: python-hyper's
`hpack`), DATA with flow control both ways, WINDOW_UPDATE, PING, RST_STREAM and GOAWAY both ways.
PRIORITY frames are ignored. A malformed frame, a PUSH_PROMISE, a window overrun or a header
block that does not decode is a connection error: GOAWAY, then the connection is closed. No h2c
upgrade: gRPC clients speak HTTP/2 from the first byte.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import Callable

import hpack

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE = range(9)
CONTINUATION = 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR = 0x6, 0x7, 0x9
_HEADER_TABLE_SIZE, _MAX_CONCURRENT_STREAMS, _INITIAL_WINDOW_SIZE = 0x1, 0x3, 0x4
_MAX_FRAME_SIZE, _MAX_HEADER_LIST_SIZE = 0x5, 0x6

MAX_WINDOW = 2**31 - 1
FRAME_BYTES = 16_384  # the largest frame we accept (the protocol's default; not raised)
# Per stream, what a client may send before we read it: bounds a stream nobody reads.
STREAM_WINDOW = 1 << 20
CONNECTION_WINDOW = 16 << 20  # the connection's window is given back as frames arrive
MAX_STREAMS = 8192  # concurrent streams per connection; a proxy opens another connection past it
MAX_HEADER_LIST = 64 << 10
_FRAME = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _FRAME.pack(len(payload) << 8 | kind, flags, stream_id) + payload


class ConnectionError_(Exception):
    """The peer broke the protocol: the connection ends with GOAWAY(code)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Stream:
    """One request: its headers, the request's DATA as it comes, the answer as it goes out."""

    __slots__ = (
        "_chunks",
        "_drained",
        "_out",
        "_out_end",
        "_trailers",
        "_unacked",
        "_waiter",
        "conn",
        "ended",
        "headers",
        "id",
        "on_reset",
        "recv_window",
        "reset",
        "sent_end",
        "window",
    )  # fmt: skip

    def __init__(self, conn: H2Connection, stream_id: int, headers: dict[str, str]) -> None:
        self.conn, self.id, self.headers = conn, stream_id, headers
        self.ended = False  # the client ended its side (END_STREAM)
        self.reset = False  # either side reset the stream, or the connection went
        self.sent_end = False  # our END_STREAM went out
        self.on_reset: Callable[[], object] | None = None
        self._chunks: deque[bytes] = deque()
        self._waiter: asyncio.Future | None = None
        self.recv_window = STREAM_WINDOW  # what the client may still send
        self._unacked = 0  # bytes read and not yet given back with WINDOW_UPDATE
        self.window = conn.peer_window  # what we may send (the client's window for us)
        self._out: deque[memoryview] = deque()  # DATA waiting for window
        self._out_end = False
        self._trailers: bytes | None = None  # HEADERS that follow the waiting DATA
        self._drained: asyncio.Future | None = None

    # ---- in ---------------------------------------------------------------------------------

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
            self.recv_window += self._unacked
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
        if end:
            self.sent_end = True
        if self._out:
            self._trailers = block
            return
        self.conn.send_headers(self, block, end)

    def send_data(self, data: bytes, end: bool = False) -> None:
        """DATA as the windows allow; the rest waits for WINDOW_UPDATE (`drain()`)."""
        if self.reset or self.sent_end:
            return
        self._out.append(memoryview(data))
        self._out_end = end
        if end:
            self.sent_end = True
        self.conn.pump(self)

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

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)


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
        self._decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)
        self._known_blocks: dict[bytes, dict[str, str]] = {}
        self._buf = bytearray()  # a partial frame
        self._preface = False
        self._header_block: tuple[int, int, bytearray] | None = None  # (stream, flags, block)
        self._recv_window = CONNECTION_WINDOW
        self._out: list[bytes] = []
        self._closed = asyncio.Event()

    # ---- transport callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        settings = b"".join(
            struct.pack(">HI", k, v)
            for k, v in ((_MAX_CONCURRENT_STREAMS, MAX_STREAMS),
                         (_INITIAL_WINDOW_SIZE, STREAM_WINDOW),
                         (_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST))
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
            s._wake_writer()

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
                    raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 client preface")
                pos, self._preface = len(PREFACE), True
            while n - pos >= 9:
                head, flags, stream_id = _FRAME.unpack_from(data, pos)
                length = head >> 8
                if length > FRAME_BYTES:
                    raise ConnectionError_(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                if n - pos - 9 < length:
                    break
                payload = data[pos + 9 : pos + 9 + length]
                pos += 9 + length
                self._on_frame(head & 0xFF, flags, stream_id & MAX_WINDOW, payload)
            if pos < n:
                self._buf += data[pos:]
        except ConnectionError_ as e:
            self._fail(e.code, str(e))
        except Exception:  # a bug here must not take the process down: end this connection
            log.exception("ext_proc connection: unexpected error; closing it")
            self._fail(INTERNAL_ERROR, "internal error")

    # ---- frames in ------------------------------------------------------------------------

    def _on_frame(self, kind: int, flags: int, stream_id: int, p: bytes) -> None:
        if self._header_block is not None and kind != CONTINUATION:
            raise ConnectionError_(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self._on_data(flags, stream_id, p)
        elif kind == HEADERS:
            if stream_id == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "HEADERS on stream 0")
            p = _unpad(flags, p)
            if flags & PRIORITY_FLAG:
                p = p[5:]
            self._header_block = (stream_id, flags, bytearray(p))
            if flags & END_HEADERS:
                self._end_header_block()
        elif kind == CONTINUATION:
            if self._header_block is None or self._header_block[0] != stream_id:
                raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            self._header_block[2].extend(p)
            if len(self._header_block[2]) > MAX_HEADER_LIST:
                raise ConnectionError_(COMPRESSION_ERROR, "header block too large")
            if flags & END_HEADERS:
                self._end_header_block()
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, p)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, p)
        elif kind == PING:
            if len(p) != 8 or stream_id:
                raise ConnectionError_(FRAME_SIZE_ERROR, "PING is 8 bytes on stream 0")
            if not flags & ACK:
                self.write(frame(PING, ACK, 0, p))
        elif kind == RST_STREAM:
            if len(p) != 4 or not stream_id:
                raise ConnectionError_(FRAME_SIZE_ERROR, "bad RST_STREAM")
            if (s := self.streams.get(stream_id)) is not None:
                self._drop(s)
        elif kind == GOAWAY:
            self.closing = True  # the client opens no more streams here; those open go on
        elif kind == PUSH_PROMISE:
            raise ConnectionError_(PROTOCOL_ERROR, "a client sent PUSH_PROMISE")
        # PRIORITY and unknown frame types are ignored (RFC 9113 5.5, 6.3)

    def _on_data(self, flags: int, stream_id: int, p: bytes) -> None:
        if stream_id == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "DATA on stream 0")
        self._recv_window -= len(p)
        if self._recv_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "the connection window was overrun")
        if self._recv_window <= CONNECTION_WINDOW // 2:  # given back at once: streams bound it
            grow = CONNECTION_WINDOW - self._recv_window
            self.write(frame(WINDOW_UPDATE, 0, 0, grow.to_bytes(4, "big")))
            self._recv_window = CONNECTION_WINDOW
        s = self.streams.get(stream_id)
        if s is None:
            if stream_id > self.last_stream_id:
                raise ConnectionError_(PROTOCOL_ERROR, "DATA on an idle stream")
            return  # a stream closed or reset a moment ago
        if s.ended:
            raise ConnectionError_(PROTOCOL_ERROR, "DATA after END_STREAM")
        s.recv_window -= len(p)
        if s.recv_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "a stream window was overrun")
        body = _unpad(flags, p)
        pad = len(p) - len(body)
        if pad:  # padding is never read: given back now
            s._unacked += pad
        if body:
            s._chunks.append(body)
        if flags & END_STREAM:
            s.ended = True
        s._wake()

    def _end_header_block(self) -> None:
        assert self._header_block is not None
        stream_id, flags, block = self._header_block
        self._header_block = None
        headers = self._decode(bytes(block))
        s = self.streams.get(stream_id)
        if s is not None:  # trailers: the client's side ends
            s.ended = True
            s._wake()
            return
        if stream_id % 2 == 0:
            raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        if stream_id <= self.last_stream_id:
            return  # trailers of a stream that closed a moment ago
        self.last_stream_id = stream_id
        if self.closing or len(self.streams) >= MAX_STREAMS:
            self.write(frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
            return
        s = self.streams[stream_id] = Stream(self, stream_id, headers)
        s.ended = bool(flags & END_STREAM)
        self.on_stream(s)

    def _decode(self, block: bytes) -> dict[str, str]:
        """HPACK. A block that left the dynamic table as it was decodes the same way until the
        table changes, and a proxy sends the same one for every stream (Envoy: 47 bytes, all
        indexed but a Huffman-coded :path): remembered, it costs a lookup, not a decode."""
        known = self._known_blocks.get(block)
        if known is not None:
            return dict(known)
        table = self._decoder.header_table
        before = (len(table.dynamic_entries), table.maxsize, _first(table.dynamic_entries))
        try:
            fields = self._decoder.decode(block, raw=True)
        except hpack.HPACKError as e:
            raise ConnectionError_(COMPRESSION_ERROR, f"header block: {e}") from None
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in fields}
        after = (len(table.dynamic_entries), table.maxsize, _first(table.dynamic_entries))
        if after[:2] != before[:2] or after[2] is not before[2]:
            self._known_blocks.clear()  # decoded against another table from now on
        elif len(self._known_blocks) < 64:
            self._known_blocks[block] = headers
        return dict(headers)

    def _on_settings(self, flags: int, stream_id: int, p: bytes) -> None:
        if stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(p) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS of a partial entry")
        for i in range(0, len(p), 6):
            key, value = struct.unpack_from(">HI", p, i)
            if key == _INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "initial window too large")
                delta, self.peer_window = value - self.peer_window, value
                for s in self.streams.values():
                    s.window += delta
            elif key == _MAX_FRAME_SIZE:
                if not 16_384 <= value < 1 << 24:
                    raise ConnectionError_(PROTOCOL_ERROR, f"max frame size {value}")
                self.peer_frame_bytes = value
            # HEADER_TABLE_SIZE: our answers use no dynamic table; the rest limit the client.
        self.write(frame(SETTINGS, ACK, 0))
        for s in list(self.streams.values()):
            self.pump(s)

    def _on_window_update(self, stream_id: int, p: bytes) -> None:
        if len(p) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "WINDOW_UPDATE is 4 bytes")
        grow = int.from_bytes(p, "big") & MAX_WINDOW
        if stream_id == 0:
            self.send_window += grow
            if grow == 0 or self.send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "bad connection WINDOW_UPDATE")
            for s in list(self.streams.values()):
                self.pump(s)
        elif (s := self.streams.get(stream_id)) is not None:
            s.window += grow
            self.pump(s)

    # ---- frames out -----------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Queued, and written once per loop iteration: the answers a message produced go out
        in one system call."""
        if not self._out:
            self.loop.call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(out)

    def send_headers(self, s: Stream, block: bytes, end: bool) -> None:
        n = self.peer_frame_bytes
        pieces = [block[i : i + n] for i in range(0, len(block), n)] or [b""]
        for i, piece in enumerate(pieces):
            last = END_HEADERS if i == len(pieces) - 1 else 0
            if i == 0:
                self.write(frame(HEADERS, last | (END_STREAM if end else 0), s.id, piece))
            else:
                self.write(frame(CONTINUATION, last, s.id, piece))
        if end:
            self._ended(s)

    def pump(self, s: Stream) -> None:
        """Send as much of `s`'s waiting DATA as the windows allow."""
        out = s._out
        while out:
            head = out[0]
            n = min(len(head), s.window, self.send_window, self.peer_frame_bytes)
            if n <= 0 and len(head):
                return  # until WINDOW_UPDATE
            last = n == len(head) and len(out) == 1
            flags = END_STREAM if last and s._out_end and s._trailers is None else 0
            self.write(frame(DATA, flags, s.id, bytes(head[:n])))
            s.window -= n
            self.send_window -= n
            if n == len(head):
                out.popleft()
            else:
                out[0] = head[n:]
        if s._trailers is not None:
            block, s._trailers = s._trailers, None
            self.send_headers(s, block, True)
        elif s._out_end:
            self._ended(s)
        s._wake_writer()

    def _ended(self, s: Stream) -> None:
        """Our END_STREAM is out: the stream closes once the client's side ended too; a client
        still sending is told to stop (RST_STREAM NO_ERROR, RFC 9113 8.1)."""
        s._out_end = False
        if not s.ended:
            self.write(frame(RST_STREAM, 0, s.id, NO_ERROR.to_bytes(4, "big")))
        self.streams.pop(s.id, None)

    def _drop(self, s: Stream) -> None:
        """The stream is gone (reset by the client, or the connection lost)."""
        self.streams.pop(s.id, None)
        s.reset = True
        s._out.clear()
        s._wake()
        s._wake_writer()
        if s.on_reset is not None:
            s.on_reset()

    def _fail(self, code: int, message: str) -> None:
        log.warning("ext_proc connection: %s; closing it (GOAWAY %d)", message, code)
        self.write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream_id, code)
                         + message.encode()[:200]))  # fmt: skip
        self._flush()
        if self.transport is not None:
            self.transport.close()

    # ---- shutdown ---------------------------------------------------------------------------

    def goaway(self) -> None:
        """No new streams (GOAWAY NO_ERROR); those open go on. Closed once they end."""
        if not self.closing:
            self.closing = True
            self.write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream_id, NO_ERROR)))

    def close(self) -> None:
        self._flush()
        if self.transport is not None:
            self.transport.close()

    async def wait_closed(self) -> None:
        await self._closed.wait()


def _first(entries: deque) -> object:
    return entries[0] if entries else None


def _unpad(flags: int, p: bytes) -> bytes:
    if not flags & PADDED:
        return p
    if not p or p[0] >= len(p):
        raise ConnectionError_(PROTOCOL_ERROR, "padding longer than the frame")
    return p[1 : len(p) - p[0]]
