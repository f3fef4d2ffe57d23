"""Request bodies bounded before FastAPI parses them: bytes and time, then JSON depth and element
count; the bodies being read at once, in bytes (cachekey/bodies.py, as the gateway bounds them).

FastAPI reads a body whole and hands it to `json.loads`: a 32 MiB body of `[{}, {}, ...]` under
any byte limit is still millions of Python objects (about 1 GB), and 100,000 levels of `[[[`
exhaust the parser's recursion. So this ASGI wrapper reads the body first (refusing it past
`--max-body-bytes` without reading on), then measures and parses it with the gateway's own
decoder (cachekey.json_shape), and only then lets the app see it, as JSON whatever its
content-type. Violations are a 413 or a 400 with an OpenAI error body naming the flag; a body
not whole within `--body-read-timeout` is a 408 (and the connection is closed), one past
`--body-read-budget` a 429 with Retry-After. Parsing with the gateway's decoder is what makes
the worker refuse what the gateway refuses, in its words (NaN, Infinity, lone surrogates,
UTF-16), where FastAPI's `json.loads` takes them all; it costs less than half of that
`json.loads` (17 ms against 43 ms for a 28 MB image body). An empty body goes on to the app:
some routes take none.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachekey.bodies import BodyBudget, BodyTimeout
from cachekey.json_shape import JSONShapeError, decode_json
from cachekey.openai.errors import LIMIT_EXCEEDED, APIError
from worker.server.errors import send_error

_CHECK_INLINE_BYTES = 1 << 20  # larger bodies are measured in a thread: the loop keeps serving
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
_CLOSE = (b"connection", b"close")


class BodyTooLarge(Exception):
    def __init__(self, size: int, cap: int) -> None:
        super().__init__(f"request body bytes: {size} > limit {cap} (--max-body-bytes)")


class BodyGuard:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        max_depth: int,
        max_elements: int,
        read_timeout: float,
        budget: int,
    ) -> None:
        self.app = app
        self.max_bytes, self.max_depth, self.max_elements = max_bytes, max_depth, max_elements
        self.read_timeout = read_timeout
        self.budget = BodyBudget(budget)  # every connection's, as one app serves them all

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _WITH_BODY:
            await self.app(scope, receive, send)
            return
        try:
            raw = await self._read(scope, receive)
        except BodyTooLarge as e:
            await send_error(send, 413, str(e), param="body", code=LIMIT_EXCEEDED)
            return
        except APIError as e:  # a 408 (the rest is never read: close) or the budget's 429
            extra = tuple((k.encode(), v.encode()) for k, v in (e.headers or {}).items())
            extra += (_CLOSE,) if isinstance(e, BodyTimeout) else ()
            await send_error(send, e.status, e.message, code=e.code, param=e.param, headers=extra)
            return
        if raw is None:
            return  # the client left before its body ended: nobody to answer
        try:
            if raw:
                await self._check(raw)
        except JSONShapeError as e:
            await send_error(send, 400, e.message, code=e.code)
            return
        await self.app(_as_json(scope), _replaying(raw, receive), send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes | None:
        declared = _content_length(scope)
        if declared is not None:
            if declared > self.max_bytes:
                raise BodyTooLarge(declared, self.max_bytes)
            self.budget.check(declared)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.read_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    if size + len(chunk) > self.max_bytes:
                        raise BodyTooLarge(size + len(chunk), self.max_bytes)
                    self.budget.take(len(chunk))
                    size += len(chunk)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise BodyTimeout(self.read_timeout, size) from None
        finally:
            self.budget.give(size)

    async def _check(self, raw: bytes) -> None:
        """Its shape, then strict JSON in UTF-8 (JSONShapeError), as the gateway parses it."""
        if len(raw) <= _CHECK_INLINE_BYTES:
            decode_json(raw, self.max_depth, self.max_elements)
        else:
            await asyncio.to_thread(decode_json, raw, self.max_depth, self.max_elements)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _as_json(scope: Scope) -> Scope:
    """The request, its body read as JSON whatever its content-type says, as the gateway reads
    it (FastAPI would take a body without `application/json` for a string, and refuse it as
    "not an object")."""
    headers = scope["headers"]
    for name, value in headers:
        if name == b"content-type" and value.split(b";")[0].strip().lower() == b"application/json":
            return scope
    kept = [(n, v) for n, v in headers if n != b"content-type"]
    return {**scope, "headers": [*kept, (b"content-type", b"application/json")]}


def _replaying(raw: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the app the body already read, then the client's later messages."""
    pending: list[Message] = [{"type": "http.request", "body": raw, "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()  # e.g. http.disconnect, which a streaming handler waits for

    return replay
