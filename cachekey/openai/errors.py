"""The OpenAI error, `{"error": {"message", "type", "param", "code"}}`, for gateway and worker.

`type` follows the HTTP status as OpenAI's API sets it: `invalid_request_error` for 4xx (401
and 404 included; OpenAI tells them apart by `code`, e.g. `invalid_api_key`, `model_not_found`),
`rate_limit_error` for 429 and `server_error` for 5xx. `code` is a short snake_case string or
None, never the HTTP status. `APIError` is the one exception either side raises for an answer
it gives itself. No web framework here: callers wrap the dict in their response.
"""

from __future__ import annotations

from typing import Any

INVALID_REQUEST = "invalid_request_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"

# Codes OpenAI's API uses, and a few of kvgate's own for what OpenAI has no code for.
MODEL_NOT_FOUND = "model_not_found"
INVALID_API_KEY = "invalid_api_key"
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
INVALID_VALUE = "invalid_value"
LIMIT_EXCEEDED = "limit_exceeded"
UNKNOWN_URL = "unknown_url"
METHOD_NOT_ALLOWED = "method_not_allowed"
INTERNAL_ERROR = "internal_error"
# A kvgate worker's engine: dead when the request came (any replica may serve it), or died while
# the request was in it (it may be why: a gateway does not try it on replica after replica).
ENGINE_DEAD = "engine_dead"
ENGINE_DIED = "engine_died"
# A request that was in two engines when they died: the gateway refuses it for a while.
ENGINE_KILLER = "engine_killer"
REQUEST_TIMEOUT = "request_timeout"  # a body not whole within --body-read-timeout (408)


def error_type(status: int) -> str:
    """OpenAI's `type` for an HTTP status."""
    if status == 429:
        return RATE_LIMIT
    return SERVER_ERROR if status >= 500 else INVALID_REQUEST


class APIError(Exception):
    """A request answered with an OpenAI error: HTTP status, message, the body's param and code,
    and headers the response carries (e.g. Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, dict[str, Any]]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, Any]]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def clean_message(message: str) -> str:
    """A validation message without pydantic's "Value error, " / "Assertion failed, " prefixes."""
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            return message[len(prefix) :]
    return message


def route_error(status: int, method: str, path: str, allow: str | None) -> tuple[str, str]:
    """(message, code) of a request no route takes: 404 for a path the server does not serve,
    405 for one it serves with other methods (`allow`: the methods, as in the Allow header)."""
    where = f"{method} {path[:256]}"
    if status == 405:
        use = f": use {allow}" if allow else ""
        return f"Invalid method for URL ({where}){use}", METHOD_NOT_ALLOWED
    return f"Invalid URL ({where}): no such endpoint", UNKNOWN_URL
