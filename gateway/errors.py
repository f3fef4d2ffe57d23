"""The one place where a failure on the request path becomes an OpenAI error response.

Every error a client sees is an `APIError` (cachekey.openai.errors) carrying its own status,
message, param and code: each stage raises its own subclass (a limit, an unknown API key, an
overload, every replica failed), or converts what a library raised where it was raised (the
body's JSON and its validation in gateway/serving/read.py `parse`, a render refusal in
`ProxyRequest.decide`). Anything else is a bug, answered 500 and logged. Nothing else on the
request path builds an error body.
"""

from __future__ import annotations

import json
import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from cachekey.openai.errors import (
    ENGINE_KILLER,
    INTERNAL_ERROR,
    RATE_LIMIT_EXCEEDED,
    APIError,
    route_error,
)

log = logging.getLogger(__name__)


class Overloaded(APIError):
    """No room now: 429 with Retry-After."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(
            429, message, code=RATE_LIMIT_EXCEEDED, headers={"retry-after": str(retry_after)}
        )
        self.retry_after = retry_after


class UpstreamFailed(APIError):
    """Every replica tried failed: 502; the last worker answer (a 5xx), if any, is passed on
    as it came (`answer_status`, `answer_body`)."""

    def __init__(self, reason: str, status: int | None = None, body: bytes = b"") -> None:
        super().__init__(502, f"all replicas failed: {reason}", code="upstream_failed")
        self.answer_status = status
        self.answer_body = body


class EngineKiller(APIError):
    """A request that was in two workers' engines when they died (gateway/quarantine.py)."""

    def __init__(self, ttl: float) -> None:
        held = f"; identical requests are refused for {ttl:g} s" if ttl > 0 else ""
        super().__init__(
            400,
            "this request was in flight on two workers whose engines died while serving it, "
            f"so it is not sent to another{held}",
            code=ENGINE_KILLER,
        )


def as_gateway_error(exc: BaseException) -> APIError:
    """The status, message, param and code the client sees for `exc`."""
    if isinstance(exc, APIError):
        return exc
    log.exception("unexpected error on the request path", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code=INTERNAL_ERROR)


def error_response(exc: BaseException) -> Response:
    """The response for any failure (a worker's own 5xx answer is passed on as it came)."""
    if isinstance(exc, UpstreamFailed) and exc.answer_status is not None:
        return Response(exc.answer_body, exc.answer_status, media_type="application/json")
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
