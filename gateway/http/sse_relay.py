"""Relaying a worker's answer: SSE passthrough that reads (and may hide) the usage chunk.

Once a stream has started it is passed through chunk by chunk; if it breaks, the client gets an
SSE error event and `data: [DONE]`, never a hang. Retries before the first byte:
gateway/serving/retry.py.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cachekey.openai.errors import error_body
from cachekey.openai.sse import DONE, sse_event
from gateway.accounting import CLIENT_GONE
from gateway.serving.usage import SSERelay
from gateway.upstream.pool import UpstreamError, UpstreamResponse
from kvgate_cli.drain import SHUTTING_DOWN, OpenStreams

log = logging.getLogger(__name__)


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
    resp: UpstreamResponse,
    relay: SSERelay,
    on_end: Callable[[str], None],
    on_first: Callable[[], None] = lambda: None,
    streams: OpenStreams | None = None,
) -> AsyncIterator[bytes]:
    """Yield the worker's stream; on a break after the first byte, end with an error + DONE.

    `on_first` runs at the stream's first bytes: a worker sends them with the first token.
    `on_end` gets "200" for a stream relayed to its end, `client_gone` for one closed or
    cancelled before that (the client left; the worker's connection is dropped, which stops
    it), `stream_error` for one the worker broke or ended with an error event (a worker's own
    drain cuts its streams so), `stream_cut` for one this gateway's drain cut (`streams`)."""
    status = CLIENT_GONE
    first = True
    handle = streams.add(lambda why: resp.abort(StreamCut(why))) if streams is not None else 0
    try:
        async for chunk in resp.iter_raw():
            if first:
                first = False
                on_first()
            out = relay.feed(chunk)
            if out:
                yield out
        rest = relay.flush()
        if rest:
            yield rest
        status = "stream_error" if relay.saw_error else "200"
    except StreamCut as e:
        status = "stream_cut"
        yield sse_event(json.dumps(error_body(503, str(e), code=SHUTTING_DOWN)).encode())
        if not relay.saw_done:
            yield DONE
    except UpstreamError as e:
        status = "stream_error"
        log.warning("stream from %s broke: %s", resp.origin, e)
        err = error_body(502, f"upstream stream broke: {e}", code="upstream_stream_broke")
        yield sse_event(json.dumps(err).encode())
        if not relay.saw_done:
            yield DONE
    finally:
        if streams is not None:
            streams.discard(handle)
        resp.close()
        on_end(status)


class StreamCut(UpstreamError):
    """A drain's deadline passed with this stream still open (kvgate_cli/drain.py)."""
