"""Request JSON, bounded before it is parsed: nesting depth and element count, on the raw bytes.

One implementation for both sides: the gateway parses client bodies with `decode_json`, and the
worker checks the bodies it is sent with it (worker/server/body_guard.py) before FastAPI parses
them, so both refuse the same bodies in the same words. The flags named in the errors are the
same on both.

A body under the size limit can still cost far more than its size once parsed: 32 MiB of `[{},
{}, ...]` is millions of Python objects (about 1 GB), and 100,000 levels of `[[[...` exhaust
the parser's recursion. So the shape is measured on the bytes first, with linear passes in C
(`bytes.translate`, `bytes.replace`, numpy over fixed-size chunks), and the body is parsed only
when it fits:

- elements: the number of `,` `:` `[` `{` outside strings, plus one (every value and key after
  the first needs one of them);
- depth: the deepest nesting of arrays and objects.

The common case costs one `bytes.translate` pass: counts over the whole body, strings
included, are upper bounds of both measures. Parsing is msgspec's strict UTF-8 JSON decoder,
which refuses lone UTF-16 surrogates (`"\\ud800"`), NaN, Infinity and numbers out of range, so
no such value reaches the tokenizer or the re-encoded body sent to the worker. JSON is UTF-8
(RFC 8259, 8.1): UTF-16 and UTF-32 bodies are refused; a UTF-8 byte-order mark is skipped, as
the RFC allows and Python's `json.loads` (vLLM's parser) does. Each refusal says which of these
it is, in the same words on both sides.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import numpy as np

_CHUNK = 2**20  # bytes per numpy pass: the scan's own memory is about 16 of these
_DECODER = msgspec.json.Decoder()
INVALID_JSON = "invalid_json"  # the code of a body that is not JSON, gateway and worker alike
_QUOTE, _OPENS, _CLOSES, _SEPS = 34, (91, 123), (93, 125), (44, 58)
_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b"[]{},:")
_BOM = b"\xef\xbb\xbf"
_WIDE_BOMS = (b"\xff\xfe", b"\xfe\xff")  # UTF-16 and UTF-32, little and big endian
_AT_BYTE = re.compile(r"\(byte (\d+)\)$")
_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB]")
EMPTY_BODY = "invalid JSON body: the body is empty"
NOT_UTF8 = (
    "invalid JSON body: not UTF-8 (it holds NUL bytes or a UTF-16 byte-order mark, as UTF-16 "
    "and UTF-32 text does); JSON is UTF-8 (RFC 8259)"
)
LONE_SURROGATE = "invalid JSON body: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff)"


class JSONShapeError(ValueError):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def _counts(data: bytes | bytearray) -> tuple[int, int]:
    """(opening brackets, all structural characters) in `data`, strings included."""
    marks = data.translate(None, _NOT_STRUCTURAL)  # one pass; tiny for text and base64
    opens = marks.count(b"[") + marks.count(b"{")
    return opens, len(marks) - marks.count(b"]") - marks.count(b"}")


def _either(c: np.ndarray, pair: tuple[int, int]) -> np.ndarray:
    return (c == pair[0]) | (c == pair[1])


def measure_json(raw: bytes | bytearray) -> tuple[int, int]:
    """(elements, nesting depth) of `raw`, counting only characters outside strings.

    Escapes are dropped first (each escaped backslash, then each escaped quote), so every quote
    left opens or closes a string, and the parity of the quotes before a byte says whether it
    is inside one. Vectorized over chunks: a few passes in C per byte, whatever the content.
    """
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = np.frombuffer(raw, np.uint8)
    inside = depth = deepest = structural = 0
    for start in range(0, len(data), _CHUNK):
        c = data[start : start + _CHUNK]
        quotes = np.cumsum(c == _QUOTE, dtype=np.uint8)  # wraps at 256; only parity matters
        outside = ((quotes + inside) & 1) == 0
        inside = (inside + int(quotes[-1])) & 1
        opens = _either(c, _OPENS) & outside
        closes = _either(c, _CLOSES) & outside
        n_opens = int(np.count_nonzero(opens))
        structural += n_opens + int(np.count_nonzero(_either(c, _SEPS) & outside))
        if n_opens:
            level = depth + np.cumsum(opens.astype(np.int8) - closes, dtype=np.int32)
            deepest = max(deepest, int(level.max()))
            depth = int(level[-1])
        else:
            depth -= int(np.count_nonzero(closes))
    return structural + 1, deepest


def check_json_shape(raw: bytes | bytearray, max_depth: int, max_elements: int) -> None:
    """Raises JSONShapeError when `raw` nests deeper or holds more elements than allowed."""
    opens, structural = _counts(raw)
    if opens <= max_depth and structural < max_elements:
        return  # upper bounds: strings can only add to the counts
    elements, depth = measure_json(raw)
    if elements > max_elements:
        raise JSONShapeError(
            f"JSON elements: {elements} > limit {max_elements} (--max-json-elements)",
            "json_too_large",
        )
    if depth > max_depth:
        raise JSONShapeError(
            f"JSON nesting: depth {depth} > limit {max_depth} (--max-json-depth)",
            "json_too_deep",
        )


def decode_json(raw: bytes | bytearray, max_depth: int, max_elements: int) -> Any:
    """The parsed body, or JSONShapeError (too deep, too many elements, or not valid JSON)."""
    if raw.startswith(_BOM):
        raw = raw[len(_BOM) :]
    if not raw or raw.isspace():
        raise JSONShapeError(EMPTY_BODY, INVALID_JSON)
    if raw.startswith(_WIDE_BOMS) or b"\0" in raw:  # a NUL is never in UTF-8 JSON text
        raise JSONShapeError(NOT_UTF8, INVALID_JSON)
    check_json_shape(raw, max_depth, max_elements)
    try:
        return _DECODER.decode(raw)
    except (msgspec.MsgspecError, UnicodeError) as e:
        raise JSONShapeError(_invalid(raw, e), INVALID_JSON) from e


def _invalid(raw: bytes | bytearray, e: Exception) -> str:
    """The message of a body msgspec refused, naming what JSON forbids where msgspec's own
    words do not: NaN and Infinity, and lone surrogates (which it calls "truncated")."""
    reason = str(e)
    at = _AT_BYTE.search(reason)
    if at and raw[int(at[1]) :].startswith((b"NaN", b"Infinity")):
        return f"invalid JSON body: NaN and Infinity are not JSON numbers (byte {at[1]})"
    if "surrogate" in reason or (
        reason == "Input data was truncated" and _HIGH_SURROGATE.search(raw) and _parses(raw)
    ):
        return LONE_SURROGATE
    return f"invalid JSON body: {reason}"


def _parses(raw: bytes | bytearray) -> bool:
    """Whether Python's parser, which takes lone surrogates, takes `raw` (only ever called on a
    body msgspec refused, so it costs nothing on the request path)."""
    try:
        json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return False
    return True


def _no_constant(name: str) -> Any:
    raise ValueError(name)
