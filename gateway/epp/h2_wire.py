"""HTTP/2's wire format (RFC 9113) for gateway/epp/h2.py: frame types, flags, error codes, the
frame header, padding, and HPACK header blocks (python-hyper's `hpack` decodes them)."""

from __future__ import annotations

import struct
from collections import deque

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE = range(9)
CONTINUATION = 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x6, 0x7, 0x9, 0xB
MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 3, 4, 5, 6
MAX_WINDOW = 2**31 - 1
HEADER = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload) << 8 | kind, flags, stream_id) + payload


class H2Error(Exception):
    """The peer broke the protocol: the connection ends with GOAWAY(code)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def unpad(flags: int, p: bytes) -> bytes:
    if not flags & PADDED:
        return p
    if not p or p[0] >= len(p):
        raise H2Error(PROTOCOL_ERROR, "padding longer than the frame")
    return p[1 : len(p) - p[0]]


class HeaderBlocks:
    """A connection's HPACK decoder (its dynamic table lives as long as the connection)."""

    def __init__(self, max_list_bytes: int) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=max_list_bytes)
        self._known: dict[bytes, dict[str, str]] = {}

    def decode(self, block: bytes) -> dict[str, str]:
        """HPACK. A block that left the dynamic table as it was decodes the same way until the
        table changes, and a proxy sends the same one for every stream (Envoy: 47 bytes, all
        indexed but a Huffman-coded :path): remembered, it costs a lookup, not a decode."""
        known = self._known.get(block)
        if known is not None:
            return dict(known)
        table = self._decoder.header_table
        before = (len(table.dynamic_entries), table.maxsize, _first(table.dynamic_entries))
        try:
            fields = self._decoder.decode(block, raw=True)
        except hpack.HPACKError as e:
            raise H2Error(COMPRESSION_ERROR, f"header block: {e}") from None
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in fields}
        after = (len(table.dynamic_entries), table.maxsize, _first(table.dynamic_entries))
        if after[:2] != before[:2] or after[2] is not before[2]:
            self._known.clear()  # decoded against another table from now on
        elif len(self._known) < 64:
            self._known[block] = headers
        return dict(headers)


def _first(entries: deque) -> object:
    return entries[0] if entries else None
