"""The HTTP entry point's handler: `ProxyServing.handle` runs one request down the shared
path (gateway/serving/exchange.py) and answers it: a whole answer, a relayed stream
(gateway/http/sse_relay.py), or the error body of whatever stage failed
(`gateway.errors.error_response`). A client that leaves while its request is queued, routed or
answered is `client_gone`, and the worker's request is cancelled.
"""

from __future__ import annotations

from functools import partial

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from cachekey.bodies import BodyTimeout
from cachekey.openai.sse import SSE_MEDIA_TYPE
from gateway.accounting import CLIENT_GONE
from gateway.errors import error_response
from gateway.http.disconnect import unless_gone
from gateway.http.sse_relay import RelayResponse, relay_stream
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.routing.request import ProxyRequest
from gateway.serving.embeddings import EmbeddingProxyRequest, EmbeddingRequest
from gateway.serving.exchange import Exchange
from gateway.serving.usage import SSERelay, read_usage
from gateway.state import GatewayState
from gateway.upstream.pool import UpstreamResponse

_GONE = Response(status_code=499)  # the answer to a client that left: nobody reads it


class ProxyServing:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def chat_completions(self, request: Request) -> Response:
        return await self.handle(request, "/v1/chat/completions", ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self.handle(request, "/v1/completions", CompletionRequest)

    async def embeddings(self, request: Request) -> Response:
        return await self.handle(request, "/v1/embeddings", EmbeddingRequest, EmbeddingProxyRequest)

    async def handle(
        self,
        request: Request,
        endpoint: str,
        model_cls: type,
        proxy_cls: type[ProxyRequest] = ProxyRequest,
    ) -> Response:
        ex = Exchange(self.state, request.headers)
        streaming = False
        status, usage = CLIENT_GONE, None
        try:
            guard = partial(unless_gone, request.receive)
            answer = await ex.answer(request, endpoint, model_cls, proxy_cls, guard)
            if answer is None:  # nobody reads this answer; the worker was told to stop
                return _GONE
            resp, content = answer
            if content is None:
                streaming = True
                return _relay(ex, resp)
            status, usage = str(resp.status), read_usage(resp.status, content)
            headers = ex.replica_headers(resp.status)
            if (after := resp.headers.get(b"retry-after")) is not None:  # a worker's 429 says
                headers["retry-after"] = after.decode("latin-1")  # when to come back
            return Response(content, resp.status, headers, resp.content_type)
        except ClientDisconnect:  # left while sending its body: status stays client_gone
            return _GONE
        except Exception as e:  # every failure, from any stage, is answered here
            out = error_response(e)
            status = str(out.status_code)
            if isinstance(e, BodyTimeout):  # the rest of its body is never read
                out.headers["connection"] = "close"
            return out
        finally:
            if not streaming:
                ex.end(status, usage)


def _relay(ex: Exchange, resp: UpstreamResponse) -> Response:
    """Pass a stream through; the request ends when the stream does, however it ends."""
    px = ex.px
    assert px is not None
    relay = SSERelay(strip_usage=not px.wants_usage)

    def on_end(status: str) -> None:
        ex.end(status, relay.usage)

    async def on_close() -> None:
        # A no-op after a normal end; otherwise the client left before the first byte.
        if not ex.ended:
            resp.close()
            ex.end(CLIENT_GONE)

    gen = relay_stream(resp, relay, on_end, px.lease.first_token, ex.state.streams)
    headers_out = ex.replica_headers(resp.status)
    return RelayResponse(gen, on_close, media_type=SSE_MEDIA_TYPE, headers=headers_out)
