"""The one place where a failure on the request path becomes an OpenAI error response.

Each stage raises what it naturally raises (a limit, a render error, a validation error, an
overload, an unreachable worker); `error_response` maps every one of them to a status and an
OpenAI body (`cachekey.openai.errors`). Nothing else on the request path builds an error body.
"""

from __future__ import annotations

import json
import logging

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from cachekey.errors import RenderError
from cachekey.json_shape import INVALID_JSON
from cachekey.openai.errors import (
    INTERNAL_ERROR,
    INVALID_API_KEY,
    LIMIT_EXCEEDED,
    RATE_LIMIT_EXCEEDED,
    APIError,
    route_error,
)
from cachekey.openai.validation import validation_error
from gateway.http.limits import LimitError, render_error_hint
from gateway.routing.tenants import AuthError

log = logging.getLogger(__name__)


class Overloaded(APIError):
    """No room now: 429 with Retry-After."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(
            429, message, code=RATE_LIMIT_EXCEEDED, headers={"retry-after": str(retry_after)}
        )
        self.retry_after = retry_after


class UpstreamFailed(Exception):
    """Every replica tried failed; the last worker answer (a 5xx), if any, is passed on."""

    def __init__(self, message: str, status: int | None = None, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def as_gateway_error(exc: BaseException) -> APIError:
    """The status, message, param and code the client sees for `exc`."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, AuthError):
        return APIError(401, str(exc), code=INVALID_API_KEY, headers={"www-authenticate": "Bearer"})
    if isinstance(exc, LimitError):
        code = exc.code or LIMIT_EXCEEDED
        return APIError(exc.status, exc.message, param=exc.param, code=code)
    if isinstance(exc, RenderError):
        msg = exc.message + render_error_hint(exc)
        return APIError(exc.status_code, msg, param=exc.param, code=exc.code)
    if isinstance(exc, ValidationError):
        return validation_error(exc.errors())  # as OpenAI words them
    if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
        return APIError(400, f"invalid JSON body: {exc}", code=INVALID_JSON)
    if isinstance(exc, RecursionError):
        return APIError(400, "invalid JSON body: nested too deeply", code=INVALID_JSON)
    if isinstance(exc, UpstreamFailed):
        return APIError(502, f"all replicas failed: {exc}", code="upstream_failed")
    log.exception("unexpected error on the request path", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code=INTERNAL_ERROR)


def error_response(exc: BaseException) -> Response:
    """The response for any failure (a worker's own 5xx answer is passed on as it came)."""
    if isinstance(exc, UpstreamFailed) and exc.status is not None:
        return Response(exc.body, exc.status, media_type="application/json")
    err = as_gateway_error(exc)
    body = json.dumps(err.body()).encode()
    return Response(body, err.status, headers=err.headers, media_type="application/json")


async def http_error_response(request: Request, exc: Exception) -> Response:
    """FastAPI's own refusals (404 unknown route, 405 wrong method) as OpenAI error bodies."""
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    if exc.status_code in (404, 405):
        message, code = route_error(
            exc.status_code, request.method, request.url.path, headers.get("Allow")
        )
    else:
        message, code = str(exc.detail), None
    err = APIError(exc.status_code, message, code=code, headers=headers or None)
    return error_response(err)
