"""The worker's answers to failures: each becomes an OpenAI error (cachekey/openai/errors.py),
worded as the gateway words its own."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from cachekey.errors import PromptTooLongError, RenderError
from cachekey.json_shape import EMPTY_BODY, INVALID_JSON
from cachekey.openai.errors import (
    ENGINE_DEAD,
    ENGINE_DIED,
    INTERNAL_ERROR,
    INVALID_VALUE,
    APIError,
    error_body,
    route_error,
)
from cachekey.openai.validation import validation_error
from worker.engine.lora_adapter import LoRAError


class EngineDeadError(APIError):
    """The engine loop is dead or stalled: requests fail fast instead of hanging."""

    def __init__(self, reason: str) -> None:
        super().__init__(503, f"engine unavailable: {reason}", code=ENGINE_DEAD)


class EngineDiedError(APIError):
    """The engine loop died or stalled while this request was in it. Maybe because of it: the
    code tells a gateway not to try it on replica after replica (gateway/serving/poison.py)."""

    def __init__(self, reason: str) -> None:
        message = f"the engine died while serving this request: {reason}"
        super().__init__(503, message, code=ENGINE_DIED)


def as_api_error(exc: Exception) -> APIError:
    """Map engine/render exceptions to what the client sees; unknown ones become 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        # vLLM answers an over-long prompt with 400, whatever the render layer's default.
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, RenderError | LoRAError):
        return APIError(exc.status_code, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, ValueError):  # a value the engine does not take (`stop: ""`)
        return APIError(400, str(exc), code=INVALID_VALUE)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code=INTERNAL_ERROR)


def error_response(exc: Exception) -> JSONResponse:
    err = as_api_error(exc)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's refusal of a body, worded as the gateway words the same error."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "missing" and tuple(errors[0]["loc"]) == ("body",):
        return APIError(400, EMPTY_BODY, code=INVALID_JSON)  # the guard passes an empty body on
    if errors and errors[0].get("type") == "json_invalid":
        reason = (errors[0].get("ctx") or {}).get("error", "not valid JSON")
        return APIError(400, f"invalid JSON body: {reason}", code=INVALID_JSON)
    in_body = [{**e, "loc": tuple(e.get("loc", ()))[1:]} for e in errors]  # drop "body"
    return validation_error(in_body)


async def _error_response(_: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


def install_error_handlers(app: FastAPI) -> None:
    # error_response maps each of these to its status (unexpected ones to a 500).
    for exc_type in (APIError, RenderError, ValueError, Exception):
        app.add_exception_handler(exc_type, _error_response)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(APIError(400, f"invalid JSON body: {exc}", code=INVALID_JSON))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message, code = str(exc.detail), None
        if exc.status_code in (404, 405):  # no route: worded as the gateway words it
            allow = (exc.headers or {}).get("Allow")
            message, code = route_error(exc.status_code, request.method, request.url.path, allow)
        body = error_body(exc.status_code, message, code=code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def send_error(
    send: Send,
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """Answer with an OpenAI error body straight from an ASGI wrapper (no app, no routing)."""
    body = json.dumps(error_body(status, message, param=param, code=code)).encode()
    start_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": start_headers})
    await send({"type": "http.response.body", "body": body})
