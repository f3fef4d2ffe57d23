"""Input limits the gateway enforces before it spends any render or routing work.

Every violation is a `LimitError` whose message names the limit and the flag that sets it, e.g.
"images per request: 9 > limit 8 (--max-images-per-request)". Image bytes, pixels and prompt
tokens are enforced by cachekey's Renderer (`render_limits`), which the gateway builds from the
same config. The raw body's JSON shape (depth, element count, lone surrogates) is checked on
the bytes before anything parses them: cachekey/json_shape.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from cachekey.bodies import (
    DEFAULT_BUDGET_BODIES,
    DEFAULT_TIMEOUT_S,
    BodyBudget,
    BodyTimeout,
    budget_bytes,
)
from cachekey.errors import RenderError
from cachekey.images import check_max_pixels
from cachekey.json_shape import JSONShapeError, decode_json
from cachekey.openai.errors import LIMIT_EXCEEDED, APIError
from cachekey.render import RenderLimits, count_images
from kvgate_cli.flags import format_pixels, format_size, option, parse_pixels, parse_size

_PARSE_INLINE_BYTES = 256 * 1024


class LimitError(APIError):
    """A request past one of the limits below: its message names the limit and its flag."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str = LIMIT_EXCEEDED
    ) -> None:
        super().__init__(status, message, param=param, code=code or LIMIT_EXCEEDED)


_SIZE = {"parse": parse_size, "show": format_size, "metavar": "BYTES"}


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_body_bytes: int = option(32 * 2**20, "request body size (413 past it)", **_SIZE)
    body_read_timeout: float = option(
        DEFAULT_TIMEOUT_S,
        "seconds from a request's headers to its body's end (408 past it, connection closed)",
        metavar="SECONDS",
    )
    body_read_budget: int | None = option(
        None,
        "bytes of the request bodies being read, or read and waiting for a worker slot, across "
        "all connections (429 past it)",
        default_text=f"{DEFAULT_BUDGET_BODIES} x --max-body-bytes",
        **_SIZE,
    )
    max_messages: int = option(1024, "messages per chat request")
    max_content_parts: int = option(256, "content parts per message")
    max_images: int = option(32, "images per request", name="--max-images-per-request")
    max_image_bytes: int = option(20 * 2**20, "bytes per image, inline or fetched", **_SIZE)
    max_image_pixels: int = option(
        4096 * 4096,
        "pixels per image (WxH or a count; at most 178956970, past which Pillow refuses an "
        "image itself)",
        parse=parse_pixels,
        show=format_pixels,
        metavar="PIXELS",
    )
    max_prompt_tokens: int | None = option(
        None, "prompt tokens per request", default_text="the model's max_model_len"
    )
    max_output_tokens: int = option(32768, "max_tokens / max_completion_tokens per request")
    max_n: int = option(16, "choices (n) per request")
    max_json_depth: int = option(64, "nesting depth of a JSON request body (400 past it)")
    max_json_elements: int = option(
        1_000_000, "values (scalars, arrays, objects) in a JSON request body (400 past it)"
    )

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_messages",
            "max_content_parts",
            "max_images",
            "max_image_bytes",
            "max_image_pixels",
            "max_output_tokens",
            "max_n",
            "max_json_depth",
            "max_json_elements",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        check_max_pixels(self.max_image_pixels)
        if not self.body_read_timeout > 0:
            raise ValueError("body_read_timeout must be positive")
        budget_bytes(self.body_read_budget, self.max_body_bytes)  # raises on a bad one
        if self.max_prompt_tokens is not None and self.max_prompt_tokens <= 0:
            raise ValueError("max_prompt_tokens must be positive")
        if self.max_json_depth > 256:  # the parser itself recurses; stay far from its limit
            raise ValueError("max_json_depth must be at most 256")

    def render_limits(self) -> RenderLimits:
        return RenderLimits(
            max_model_len=self.max_prompt_tokens,
            max_images=self.max_images,
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
        )


def _over(what: str, value: int, limit: int, flag: str, status: int, param: str) -> LimitError:
    return LimitError(status, f"{what}: {value} > limit {limit} ({flag})", param)


async def read_body(request: Request, limits: RequestLimits, budget: BodyBudget) -> bytearray:
    """The request body, refused (413) by Content-Length or as soon as it grows past the limit,
    408 when it is not whole `--body-read-timeout` s after its headers, and 429 when the bodies
    being read, or read and waiting for a slot, would pass `--body-read-budget`
    (cachekey/bodies.py). A body read whole stays counted: its request gives its bytes back when
    it leaves the queue for a slot, or ends (gateway/serving/exchange.py), so the queue holds no
    more bytes than the budget either.

    The buffer grows with the bytes that arrive, never to the declared length ahead of them
    (a Content-Length alone would otherwise cost its size). Growing a large bytearray is a
    realloc, which glibc does by remapping pages, not copying them: the body is held once.
    """
    cap = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit():
        if int(declared) > cap:
            raise _over("request body bytes", int(declared), cap, "--max-body-bytes", 413, "body")
        budget.check(int(declared))
    body, whole = bytearray(), False
    try:
        async with asyncio.timeout(limits.body_read_timeout):
            async for chunk in request.stream():
                if len(body) + len(chunk) > cap:
                    end = len(body) + len(chunk)
                    raise _over("request body bytes", end, cap, "--max-body-bytes", 413, "body")
                budget.take(len(chunk))
                body += chunk
        whole = True
    except TimeoutError:
        raise BodyTimeout(limits.body_read_timeout, len(body)) from None
    finally:
        if not whole:
            budget.give(len(body))
    return body


async def read_json(request: Request, limits: RequestLimits, budget: BodyBudget) -> tuple[Any, int]:
    """The parsed body, bounded in bytes, depth and elements (cachekey/json_shape.py), or 400;
    and the bytes it still holds in `budget` (`read_body`: given back by the caller).

    A large body is measured and parsed in a thread, so the event loop keeps serving.
    """
    raw = await read_body(request, limits, budget)
    args = (raw, limits.max_json_depth, limits.max_json_elements)
    try:
        if len(raw) <= _PARSE_INLINE_BYTES:
            return decode_json(*args), len(raw)
        return await asyncio.to_thread(decode_json, *args), len(raw)
    except BaseException as e:
        budget.give(len(raw))
        if isinstance(e, JSONShapeError):
            raise LimitError(400, e.message, None, e.code) from e
        raise


def check_body(body: Any, limits: RequestLimits) -> None:
    """Shape limits on the parsed JSON, before validation or rendering (cheap counts only)."""
    if not isinstance(body, dict):
        return  # the request model reports the shape error
    _check_int(body, "max_tokens", limits.max_output_tokens, "--max-output-tokens")
    _check_int(body, "max_completion_tokens", limits.max_output_tokens, "--max-output-tokens")
    _check_int(body, "n", limits.max_n, "--max-n")
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    if len(messages) > limits.max_messages:
        raise _over(
            "messages per request", len(messages), limits.max_messages, "--max-messages", 400,
            "messages",
        )  # fmt: skip
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        if len(content) > limits.max_content_parts:
            raise _over(
                "content parts per message", len(content), limits.max_content_parts,
                "--max-content-parts", 400, f"messages[{i}].content",
            )  # fmt: skip
    if (images := count_images(messages)) > limits.max_images:
        raise _over(
            "images per request", images, limits.max_images, "--max-images-per-request", 400,
            "messages",
        )  # fmt: skip


def _check_int(body: dict, name: str, limit: int, flag: str) -> None:
    value = body.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and value > limit:
        raise _over(name, value, limit, flag, 400, name)


def default_max_tokens(
    requested: int | None, prompt_tokens: int, context_len: int, limits: RequestLimits
) -> int | None:
    """The output length of a request that names none: --max-output-tokens, within the context
    left (None when it names one, or no room is left: the worker then answers for itself).

    Without this the worker would default to the whole remaining context (vLLM's rule), which
    --max-output-tokens would never see.
    """
    left = context_len - prompt_tokens
    if requested is None and left > 0:
        return min(limits.max_output_tokens, left)
    return None


def render_refusal(exc: RenderError) -> APIError:
    """A request cachekey could not render, as the client sees it: its message names the flag
    behind a limit it passed."""
    return APIError(
        exc.status_code, exc.message + render_error_hint(exc), param=exc.param, code=exc.code
    )


def render_error_hint(exc: Exception) -> str:
    """The flag behind a cachekey limit error, so its message names the limit too."""
    name, msg = type(exc).__name__, str(exc)
    if "(--" in msg:
        return ""
    if name == "PromptTooLongError":
        return " (prompt tokens: the model's max_model_len or --max-prompt-tokens)"
    if name == "ImageTooLargeError":
        return " (--max-image-pixels)" if "pixels" in msg else " (--max-image-bytes)"
    return ""
