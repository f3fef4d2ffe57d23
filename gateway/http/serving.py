"""The request path: authenticate -> parse -> admit -> render + keys -> rank -> forward -> relay.

`OpenAIServing.handle` runs the stages of one `ProxyRequest` in order; everything up to the
routing decision (`read_request`, `ProxyRequest.route`, `ProxyRequest.decide`) is shared with
the EPP (gateway/epp/). Any failure, whichever stage raised it, becomes an OpenAI error body
in one place (`gateway.errors.error_response`), and every request ends once, in `end`: here for
an answer read whole or refused, or when a relayed stream ends. A client that leaves while its
request is queued, routed or answered is `client_gone`, and the worker's request is cancelled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from cachekey.headers import PREDICTED_HEADER, REPLICA_HEADER
from cachekey.openai.sse import SSE_MEDIA_TYPE
from gateway import accounting
from gateway.accounting import CLIENT_GONE
from gateway.embeddings import EmbeddingProxyRequest, EmbeddingRequest
from gateway.errors import error_response
from gateway.http.disconnect import unless_gone
from gateway.http.limits import check_body, read_json
from gateway.http.retry import send_with_retries
from gateway.http.sse_relay import RelayResponse, SSERelay, relay_stream
from gateway.http.upstream import UpstreamResponse
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.routing.policy_choice import policy_label
from gateway.routing.render import OpenAIRequest
from gateway.routing.request import ProxyRequest
from gateway.state import GatewayState

_GONE = Response(status_code=499)  # the answer to a client that left: nobody reads it


class RequestSource(Protocol):
    """Where a request comes from: its headers and its body as it arrives. A Starlette
    `Request` is one; the EPP (gateway/epp/) wraps an ext_proc stream as another."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def stream(self) -> AsyncIterator[bytes]: ...


def authenticate(state: GatewayState, request: RequestSource) -> str | None:
    """The request's tenant (None when the gateway has no API keys); AuthError otherwise."""
    if state.tenants is None:
        return None
    return state.tenants.authenticate(request.headers.get("authorization"))


async def parse(request: RequestSource, model_cls: type[OpenAIRequest], state: GatewayState):
    """The parsed request: body size, JSON, shape limits, then the request model."""
    limits = state.config.limits
    data = await read_json(request, limits)  # bounded in bytes, depth and elements
    check_body(data, limits)
    return model_cls.model_validate(data)


async def read_request(
    state: GatewayState, request: RequestSource, model_cls: type[OpenAIRequest]
) -> tuple[OpenAIRequest, str | None]:
    """authenticate -> parse -> the tenant's cache salt: the request as it is routed, and its
    tenant (None when the gateway has no API keys)."""
    tenant = authenticate(state, request)
    body = await parse(request, model_cls, state)
    if tenant is not None and state.tenants is not None:
        # Replaces any client salt by one derived from (tenant, client salt): the routing keys
        # and the worker's cache both use it.
        body.cache_salt = state.tenants.salt_for(tenant, body.cache_salt)
    return body, tenant


class OpenAIServing:
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
        st = self.state
        px: ProxyRequest | None = None
        streaming = False
        status, usage = CLIENT_GONE, None
        try:
            body, tenant = await read_request(st, request, model_cls)
            px = proxy_cls.route(st, endpoint, body, request.headers, tenant=tenant)
            answer = await unless_gone(request.receive, forward(px, bool(body.stream)))
            if answer is None:  # nobody reads this answer; the worker was told to stop
                return _GONE
            resp, content = answer
            if content is None:
                streaming = True
                return _relay(st, request.headers, px, resp)
            status, usage = str(resp.status), read_usage(resp.status, content)
            headers = replica_headers(px, resp.status)
            return Response(content, resp.status, headers, resp.content_type)
        except ClientDisconnect:  # left while sending its body: status stays client_gone
            return _GONE
        except Exception as e:  # every failure, from any stage, is answered here
            out = error_response(e)
            status = str(out.status_code)
            return out
        finally:
            if not streaming:
                end(st, request.headers, px, status, usage)


def end(
    state: GatewayState,
    headers: Mapping[str, str],
    px: ProxyRequest | None,
    status: str,
    usage: dict | None = None,
) -> None:
    """The one place a request ends, in both modes, whatever stage it reached: a routed request
    gives its slot back and records its outcome (`ProxyRequest.release`); one refused before it
    was routed (auth, parse, limits, unknown model or policy, no replica) is counted as the
    gateway's own answer. `status` is the HTTP status the client got, or `client_gone`."""
    if px is not None:
        px.release(status, usage)
    else:
        accounting.answered_here(state, policy_label(state, headers), status)


async def forward(px: ProxyRequest, stream: bool) -> tuple[UpstreamResponse, bytes | None]:
    """decide -> send (with retries) -> the answer: read whole, or (content None) a stream."""
    await px.decide()
    resp = await send_with_retries(px, px.payload())
    if stream and resp.status == 200:
        return resp, None
    try:
        return resp, await resp.read()
    finally:
        resp.close()  # a no-op once read; if cancelled, drops the connection: the worker stops


def _relay(
    st: GatewayState, headers: Mapping[str, str], px: ProxyRequest, resp: UpstreamResponse
) -> Response:
    """Pass a stream through; the request ends when the stream does, however it ends."""
    relay = SSERelay(strip_usage=not px.wants_usage)

    def on_end(status: str) -> None:
        end(st, headers, px, status, relay.usage)

    async def on_close() -> None:
        # A no-op after a normal end; otherwise the client left before the first byte.
        if not px.released:
            resp.close()
            end(st, headers, px, CLIENT_GONE)

    gen = relay_stream(resp, relay, on_end, px.lease.first_token, st.streams)
    headers_out = replica_headers(px, resp.status)
    return RelayResponse(gen, on_close, media_type=SSE_MEDIA_TYPE, headers=headers_out)


def replica_headers(px: ProxyRequest, status: int) -> dict[str, str]:
    """The response headers naming the replica and, for an answer it served (not a refusal),
    its predicted cached tokens (both modes)."""
    lease = px.lease
    assert lease.replica is not None
    if status >= 400:
        return {REPLICA_HEADER: lease.replica.name}
    return {REPLICA_HEADER: lease.replica.name, PREDICTED_HEADER: str(lease.predicted)}


class _Answer(msgspec.Struct):
    """The one field of a worker's answer the gateway reads (the rest is skipped unparsed)."""

    usage: dict | None = None


_ANSWER = msgspec.json.Decoder(_Answer)


def read_usage(status: int, content: bytes) -> dict | None:
    if status != 200:
        return None
    try:
        return _ANSWER.decode(content).usage
    except msgspec.DecodeError:
        return None
