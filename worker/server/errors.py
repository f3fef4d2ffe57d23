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
from cachekey.openai_errors import clean_message
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
    return APIError(f"internal error: {type(exc).__name__}: {exc}", 500)


def error_response(exc: Exception) -> JSONResponse:
    err = as_api_error(exc)
    return JSONResponse(
        error_body(err.message, err.status_code, param=err.param, code=err.code),
        status_code=err.status_code,
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "malformed JSON body", None
    param = ".".join(loc) or None
    return f"{param or 'body'}: {clean_message(first.get('msg', 'invalid value'))}", param


async def _error_response(_: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


def install_error_handlers(app: FastAPI) -> None:
    # error_response maps each of these to its status (unexpected ones to a 500).
    for exc_type in (APIError, RenderError, ValueError, Exception):
        app.add_exception_handler(exc_type, _error_response)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, 400, param=param), status_code=400)

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return JSONResponse(error_body(f"malformed JSON body: {exc}", 400), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), exc.status_code), status_code=exc.status_code
        )


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
