"""Reading a request, the first stage of the shared path (gateway/serving/exchange.py): its API
key (the tenant), then its body: size, JSON, shape limits, the request model. What the JSON
decoder or the model refuses becomes its `APIError` here, where it is raised."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from pydantic import ValidationError

from cachekey.json_shape import INVALID_JSON
from cachekey.openai.errors import APIError
from cachekey.openai.protocol import OpenAIRequest
from cachekey.openai.validation import validation_error
from gateway.limits import check_body, read_json
from gateway.state import GatewayState


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


async def parse(
    request: RequestSource, model_cls: type[OpenAIRequest], state: GatewayState
) -> tuple[OpenAIRequest, int]:
    """The parsed request: body size, JSON, shape limits, then the request model; and the body's
    bytes still held in `state.bodies`, which the caller gives back. What the JSON decoder or
    the model refuses becomes its `APIError` here, where it is raised (and its bytes are given
    back)."""
    limits = state.config.limits
    try:
        data, held = await read_json(request, limits, state.bodies)  # bytes, time, depth, elements
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"invalid JSON body: {e}", code=INVALID_JSON) from e
    except RecursionError as e:
        raise _too_deep() from e
    try:
        check_body(data, limits)
        return model_cls.model_validate(data), held
    except BaseException as e:
        state.bodies.give(held)
        if isinstance(e, ValidationError):
            raise validation_error(e.errors()) from e  # as OpenAI words them
        if isinstance(e, RecursionError):
            raise _too_deep() from e
        raise


def _too_deep() -> APIError:
    return APIError(400, "invalid JSON body: nested too deeply", code=INVALID_JSON)


async def read_request(
    state: GatewayState, request: RequestSource, model_cls: type[OpenAIRequest]
) -> tuple[OpenAIRequest, str | None, int]:
    """authenticate -> parse -> the tenant's cache salt: the request as it is routed, its
    tenant (None when the gateway has no API keys), and its body's bytes still held in
    `state.bodies` (given back once the request has a slot, or ends: `Exchange`)."""
    tenant = authenticate(state, request)
    body, held = await parse(request, model_cls, state)
    if tenant is not None and state.tenants is not None:
        # Replaces any client salt by one derived from (tenant, client salt): the routing keys
        # and the worker's cache both use it.
        body.cache_salt = state.tenants.salt_for(tenant, body.cache_salt)
    return body, tenant, held
