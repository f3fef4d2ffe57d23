"""The HTTP/2 frames a client sends, handled for one connection (gateway/epp/h2.py), and the
limits this server announces and enforces."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Protocol

from .h2_stream import Connection, Stream
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
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_FRAME_SIZE,
    MAX_WINDOW,
    PING,
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


class FramesHost(Connection, Protocol):
    """What the frames in read and change of their connection (H2Connection, h2.py), beyond
    what its streams need of it."""

    on_stream: Callable[[Stream], None]
    streams: dict[int, Stream]
    last_stream_id: int
    closing: bool

    def drop(self, s: Stream) -> None: ...


class FramesIn:
    """The frames a client sends, handled for one connection, which holds this (H2Connection in
    h2.py is the rest: the transport, writes and shutdown). It owns the reading side's state:
    the header block being read, the connection's receive window, the streams opened and reset."""

    __slots__ = ("_blocks", "_early_resets", "_header_block", "_opened", "_recv_window", "conn")

    def __init__(self, conn: FramesHost) -> None:
        self.conn = conn
        self._blocks = HeaderBlocks(MAX_HEADER_LIST)
        self._header_block: tuple[int, int, bytearray] | None = None  # (stream, flags, block)
        self._recv_window = CONNECTION_WINDOW
        self._opened = 0  # streams the client opened
        self._early_resets = 0  # of them, reset by the client before our answer ended

    # ---- frames in ------------------------------------------------------------------------

    def on_frame(self, kind: int, flags: int, stream_id: int, p: bytes) -> None:
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
                self.conn.write(frame(PING, ACK, 0, p))
        elif kind == RST_STREAM:
            if len(p) != 4 or not stream_id:
                raise H2Error(FRAME_SIZE_ERROR, "bad RST_STREAM")
            if (s := self.conn.streams.get(stream_id)) is not None:
                self.conn.drop(s)
                self._early_resets += 1
                if self._opened >= RESET_FLOOR and 2 * self._early_resets >= self._opened:
                    raise H2Error(ENHANCE_YOUR_CALM, "the client resets most streams it opens")
        elif kind == GOAWAY:
            self.conn.closing = True  # the client opens no more streams here; those open go on
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
            self.conn.write(frame(WINDOW_UPDATE, 0, 0, grow.to_bytes(4, "big")))
            self._recv_window = CONNECTION_WINDOW
        s = self.conn.streams.get(stream_id)
        if s is None:
            if stream_id > self.conn.last_stream_id:
                raise H2Error(PROTOCOL_ERROR, "DATA on an idle stream")
            return  # a stream closed or reset a moment ago
        body = unpad(flags, p)
        s.received(len(p), body, bool(flags & END_STREAM))

    def _end_header_block(self) -> None:
        assert self._header_block is not None
        stream_id, flags, block = self._header_block
        self._header_block = None
        headers = self._blocks.decode(bytes(block))
        s = self.conn.streams.get(stream_id)
        if s is not None:  # trailers: the client's side ends
            s.end_received()
            return
        if stream_id % 2 == 0:
            raise H2Error(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        if stream_id <= self.conn.last_stream_id:
            return  # trailers of a stream that closed a moment ago
        self.conn.last_stream_id = stream_id
        if self.conn.closing or len(self.conn.streams) >= MAX_STREAMS:
            self.conn.write(frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
            return
        self._opened += 1
        s = self.conn.streams[stream_id] = Stream(self.conn, stream_id, headers)
        s.ended = bool(flags & END_STREAM)
        self.conn.on_stream(s)

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
                delta, self.conn.peer_window = value - self.conn.peer_window, value
                for s in self.conn.streams.values():
                    s.window += delta
            elif key == MAX_FRAME_SIZE:
                if not 16_384 <= value < 1 << 24:
                    raise H2Error(PROTOCOL_ERROR, f"max frame size {value}")
                self.conn.peer_frame_bytes = value
            # HEADER_TABLE_SIZE: our answers use no dynamic table; the rest limit the client.
        self.conn.write(frame(SETTINGS, ACK, 0))
        for s in list(self.conn.streams.values()):
            s.pump()

    def _on_window_update(self, stream_id: int, p: bytes) -> None:
        if len(p) != 4:
            raise H2Error(FRAME_SIZE_ERROR, "WINDOW_UPDATE is 4 bytes")
        grow = int.from_bytes(p, "big") & MAX_WINDOW
        if stream_id == 0:
            self.conn.send_window += grow
            if grow == 0 or self.conn.send_window > MAX_WINDOW:
                raise H2Error(FLOW_CONTROL_ERROR, "bad connection WINDOW_UPDATE")
            for s in list(self.conn.streams.values()):
                s.pump()
        elif (s := self.conn.streams.get(stream_id)) is not None:
            s.window += grow
            s.pump()
