"""Input limits the gateway enforces before it spends any render or routing work.

Every violation is a `LimitError` whose message names the limit and the flag that sets it, e.g.
"images per request: 9 > limit 8 (--max-images-per-request)". Image bytes, pixels and prompt
tokens are enforced by cachekey's Renderer (`render_limits`), which the gateway builds from the
same config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from cachekey.flags import format_pixels, format_size, option, parse_pixels, parse_size
from cachekey.render import IMAGE_PART_TYPES, RenderLimits


class LimitError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


_SIZE = {"parse": parse_size, "show": format_size, "metavar": "BYTES"}


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_body_bytes: int = option(32 * 2**20, "request body size (413 past it)", **_SIZE)
    max_messages: int = option(1024, "messages per chat request")
    max_content_parts: int = option(256, "content parts per message")
    max_images: int = option(32, "images per request", name="--max-images-per-request")
    max_image_bytes: int = option(20 * 2**20, "bytes per image, inline or fetched", **_SIZE)
    max_image_pixels: int = option(
        4096 * 4096,
        "pixels per image (WxH or a count)",
        parse=parse_pixels,
        show=format_pixels,
        metavar="PIXELS",
    )
    max_prompt_tokens: int | None = option(
        None, "prompt tokens per request", default_text="the model's max_model_len"
    )
    max_output_tokens: int = option(32768, "max_tokens / max_completion_tokens per request")
    max_n: int = option(16, "choices (n) per request")

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
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens <= 0:
            raise ValueError("max_prompt_tokens must be positive")

    def render_limits(self) -> RenderLimits:
        return RenderLimits(
            max_model_len=self.max_prompt_tokens,
            max_images=self.max_images,
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
        )


def _over(what: str, value: int, limit: int, flag: str, status: int, param: str) -> LimitError:
    return LimitError(status, f"{what}: {value} > limit {limit} ({flag})", param)


async def read_body(request: Request, limits: RequestLimits) -> bytes:
    """The request body, refused (413) by Content-Length or as soon as it grows past the limit."""
    cap = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise _over("request body bytes", int(declared), cap, "--max-body-bytes", 413, "body")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise _over("request body bytes", size, cap, "--max-body-bytes", 413, "body")
        chunks.append(chunk)
    return b"".join(chunks)


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
    images = 0
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        if len(content) > limits.max_content_parts:
            raise _over(
                "content parts per message", len(content), limits.max_content_parts,
                "--max-content-parts", 400, f"messages[{i}].content",
            )  # fmt: skip
        images += sum(
            1 for p in content if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
        )
    if images > limits.max_images:
        raise _over(
            "images per request", images, limits.max_images, "--max-images-per-request", 400,
            "messages",
        )  # fmt: skip


def _check_int(body: dict, name: str, limit: int, flag: str) -> None:
    value = body.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and value > limit:
        raise _over(name, value, limit, flag, 400, name)


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
