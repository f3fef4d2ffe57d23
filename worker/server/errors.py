"""OpenAI-style error bodies and the exceptions the service turns into them."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from cachekey import openai_errors
from cachekey.errors import PromptTooLongError, RenderError
from cachekey.json_shape import INVALID_JSON
from cachekey.openai_errors import INTERNAL_ERROR, route_error
from cachekey.validation_errors import invalid_request
from worker.engine.lora_adapter import LoRAError


class APIError(Exception):
    """An error the client should see, with its HTTP status."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code


class EngineDeadError(APIError):
    """The engine loop is dead or stalled: requests fail fast instead of hanging."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"engine unavailable: {reason}", 503, code="engine_dead")


def error_body(
    message: str, status_code: int, *, param: str | None = None, code: str | None = None
) -> dict:
    return openai_errors.error_body(status_code, message, param=param, code=code)


def as_api_error(exc: Exception) -> APIError:
    """Map engine/render exceptions to what the client sees; unknown ones become 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        # vLLM answers an over-long prompt with 400, whatever the render layer's default.
        return APIError(exc.message, 400, param=exc.param, code=exc.code)
    if isinstance(exc, RenderError | LoRAError):
        return APIError(exc.message, exc.status_code, param=exc.param, code=exc.code)
    if isinstance(exc, ValueError):
        return APIError(str(exc), 400)
    return APIError(f"internal error: {type(exc).__name__}: {exc}", 500, code=INTERNAL_ERROR)


def error_response(exc: Exception) -> JSONResponse:
    err = as_api_error(exc)
    return JSONResponse(
        error_body(err.message, err.status_code, param=err.param, code=err.code),
        status_code=err.status_code,
    )


def _validation_error(exc: RequestValidationError) -> APIError:
    """The gateway's wording of the same error (cachekey/validation_errors.py)."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        reason = (errors[0].get("ctx") or {}).get("error", "not valid JSON")
        return APIError(f"invalid JSON body: {reason}", 400, code=INVALID_JSON)
    in_body = [{**e, "loc": tuple(e.get("loc", ()))[1:]} for e in errors]  # drop "body"
    message, param, code = invalid_request(in_body)
    return APIError(message, 400, param=param, code=code)


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
        return error_response(APIError(f"invalid JSON body: {exc}", 400, code=INVALID_JSON))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message, code = str(exc.detail), None
        if exc.status_code in (404, 405):  # no route: worded as the gateway words it
            allow = (exc.headers or {}).get("Allow")
            message, code = route_error(exc.status_code, request.method, request.url.path, allow)
        body = error_body(message, exc.status_code, code=code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def send_error(
    send: Send,
    status_code: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """Answer with an OpenAI error body straight from an ASGI wrapper (no app, no routing)."""
    body = json.dumps(error_body(message, status_code, param=param, code=code)).encode()
    start_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status_code, "headers": start_headers})
    await send({"type": "http.response.body", "body": body})
