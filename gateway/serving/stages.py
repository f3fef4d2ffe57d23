"""The stages of the request path both entry points run, in order: `read_request`
(authenticate -> parse), `ProxyRequest.route` and `forward` (decide -> send with retries ->
the answer), then `end`, the one place a request ends, whatever stage it reached.

gateway/http/serving.py (`OpenAIServing.handle`) and gateway/epp/stream.py call them; any
failure, whichever stage raised it, is an `APIError` the caller answers with.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from pydantic import ValidationError

from cachekey.headers import PREDICTED_HEADER, REPLICA_HEADER
from cachekey.json_shape import INVALID_JSON
from cachekey.openai.errors import APIError
from cachekey.openai.validation import validation_error
from gateway import accounting
from gateway.limits import check_body, read_json
from gateway.routing.policy_choice import policy_label
from gateway.routing.render import OpenAIRequest
from gateway.routing.request import ProxyRequest
from gateway.serving.retry import send_with_retries
from gateway.state import GatewayState
from gateway.upstream.pool import UpstreamResponse


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
    """The parsed request: body size, JSON, shape limits, then the request model. What the JSON
    decoder or the model refuses becomes its `APIError` here, where it is raised."""
    limits = state.config.limits
    try:
        data = await read_json(request, limits)  # bounded in bytes, depth and elements
        check_body(data, limits)
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from e  # as OpenAI words them
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"invalid JSON body: {e}", code=INVALID_JSON) from e
    except RecursionError as e:
        raise APIError(400, "invalid JSON body: nested too deeply", code=INVALID_JSON) from e


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


def replica_headers(px: ProxyRequest, status: int) -> dict[str, str]:
    """The response headers naming the replica and, for an answer it served (not a refusal),
    its predicted cached tokens (both modes)."""
    lease = px.lease
    assert lease.replica is not None
    if status >= 400:
        return {REPLICA_HEADER: lease.replica.name}
    return {REPLICA_HEADER: lease.replica.name, PREDICTED_HEADER: str(lease.predicted)}
