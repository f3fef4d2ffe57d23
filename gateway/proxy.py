"""Forwarding to workers: pooled keep-alive httpx, retries before the first byte, SSE passthrough.

A connect error or a 5xx before any byte reached the client moves on to the next replica in
the ranking. Once a stream has started it is passed through chunk by chunk; if it breaks, the
client gets an SSE error event and `data: [DONE]`, never a hang.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.protocol import error_body
from gateway.replicas import Replica

log = logging.getLogger(__name__)

_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Attempt:
    """The outcome of trying replicas in order: the replica that answered and its response."""

    replica: Replica
    response: httpx.Response
    retried: int


class NoReplicaError(Exception):
    def __init__(
        self, message: str, last_status: int | None = None, last_body: bytes = b""
    ) -> None:
        super().__init__(message)
        self.last_status = last_status
        self.last_body = last_body


async def send_with_retries(
    ranked: list[Replica],
    path: str,
    body: bytes,
    *,
    stream: bool,
    max_attempts: int,
    on_try: Callable[[Replica], None],
    on_fail: Callable[[Replica], None],
) -> Attempt:
    """POST `body` to the replicas in order until one answers without a connect error or 5xx."""
    last_status, last_body, last_err = None, b"", "no replica available"
    for n, rep in enumerate(ranked[:max_attempts]):
        on_try(rep)
        headers = {"content-type": "application/json"}
        if rep.dp_rank is not None:
            headers["X-data-parallel-rank"] = str(rep.dp_rank)
        assert rep.client is not None
        req = rep.client.build_request("POST", f"{rep.url}{path}", content=body, headers=headers)
        try:
            resp = await rep.client.send(req, stream=stream)
        except httpx.TransportError as e:
            last_err = f"{rep.id}: {type(e).__name__}"
            on_fail(rep)
            continue
        if resp.status_code >= 500:
            last_status = resp.status_code
            last_body = await resp.aread()
            await resp.aclose()
            last_err = f"{rep.id}: HTTP {resp.status_code}"
            on_fail(rep)
            continue
        return Attempt(rep, resp, n)
    raise NoReplicaError(last_err, last_status, last_body)


class SSERelay:
    """Relays a worker's SSE stream, reading the usage chunk and hiding it if unasked for."""

    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage: dict | None = None
        self.saw_done = False
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        self._buf += chunk
        if b"\n\n" not in self._buf:
            return b""
        head, _, self._buf = self._buf.rpartition(b"\n\n")
        out = []
        for event in head.split(b"\n\n"):
            if self._keep(event):
                out.append(event + b"\n\n")
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest

    def _keep(self, event: bytes) -> bool:
        if event.startswith(b"data: [DONE]"):
            self.saw_done = True
            return True
        if b'"usage"' not in event or b'"usage":null' in event or b'"usage": null' in event:
            return True
        try:
            data = json.loads(event[event.index(b"{") :])
        except ValueError:
            return True
        usage = data.get("usage") if isinstance(data, dict) else None
        if usage:
            self.usage = usage
            if self.strip_usage and not data.get("choices"):
                return False
        return True


class RelayResponse(StreamingResponse):
    """A relayed stream whose end runs even when the client left before the first byte.

    If the client is gone by the time the response starts, Starlette fails on the first send and
    never iterates the generator, so the generator's own `finally` never runs: the replica slot,
    the in-flight accounting and the upstream connection would leak. `on_close` must be
    idempotent; it also runs after a normal end, where it is a no-op.
    """

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], object], **kwargs: object
    ) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            result = self._on_close()
            if hasattr(result, "__await__"):
                await result


async def relay_stream(
    resp: httpx.Response, relay: SSERelay, on_end: Callable[[str], None]
) -> AsyncIterator[bytes]:
    """Yield the worker's stream; on a break after the first byte, end with an error + DONE."""
    status = "200"
    try:
        async for chunk in resp.aiter_raw():
            out = relay.feed(chunk)
            if out:
                yield out
        rest = relay.flush()
        if rest:
            yield rest
    except httpx.HTTPError as e:
        status = "stream_error"
        log.warning("stream from %s broke: %s", resp.request.url, e)
        err = error_body(f"upstream stream broke: {type(e).__name__}", "server_error", code=502)
        yield b"data: " + json.dumps(err).encode() + b"\n\n"
        if not relay.saw_done:
            yield _DONE
    finally:
        await resp.aclose()
        on_end(status)
