"""Typed render errors: each carries the HTTP status and the request field it blames.

The gateway and the worker turn these into OpenAI-style error bodies, so the message must tell
the user what to change, not where the code failed.
"""

from __future__ import annotations

from cachekey.openai.errors import CONTEXT_LENGTH_EXCEEDED, LIMIT_EXCEEDED, error_body


class RenderError(ValueError):
    """A request that cannot be rendered into a prompt."""

    status_code: int = 400
    code: str = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_dict(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI error body."""
        return error_body(self.status_code, self.message, param=self.param, code=self.code)


class InvalidImageError(RenderError):
    """The image data is not valid base64, or not an image in a supported format."""

    code = "invalid_image"


class ImageTooLargeError(RenderError):
    """The image (or its encoded form) exceeds the configured size limits."""

    status_code = 413
    code = "image_too_large"


class TooManyImagesError(RenderError):
    """More image parts than the request may carry: the count limit the gateway's
    --max-images-per-request sets, with the gateway's code and param."""

    code = LIMIT_EXCEEDED

    def __init__(self, count: int, limit: int) -> None:
        super().__init__(f"images per request: {count} > limit {limit}", param="messages")


class UnsupportedContentError(RenderError):
    """A message shape, role or content-part type this model cannot take."""

    code = "unsupported_content"


class PromptTooLongError(RenderError):
    """The rendered prompt is longer than the model (or the configured limit) allows."""

    code = CONTEXT_LENGTH_EXCEEDED


def context_exceeded(
    limit: int, prompt_tokens: int, where: str, output_tokens: int | None = None, *, param: str
) -> PromptTooLongError:
    """The one wording of a request over the model's context, gateway and worker alike (as
    OpenAI words it): the prompt alone (`where` is "messages", "prompt" or "input"), or with
    the `output_tokens` it asks for (`param` then names the output-length field)."""
    if output_tokens is None:
        return PromptTooLongError(
            f"This model's maximum context length is {limit} tokens. However, your {where} "
            f"resulted in {prompt_tokens} tokens. Please reduce the length of the {where}.",
            param=param,
        )
    return PromptTooLongError(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_tokens + output_tokens} tokens ({prompt_tokens} in the {where}, "
        f"{output_tokens} in the completion). Please reduce the length of the {where} or "
        "completion.",
        param=param,
    )


def context_exceeded_by_length(
    limit: int, at_least: int, chars: int, where: str
) -> PromptTooLongError:
    """`context_exceeded` for a prompt refused by its length alone (cachekey/token_bound.py),
    before it was tokenized: the count is the proven least."""
    return PromptTooLongError(
        f"This model's maximum context length is {limit} tokens. However, your {where} "
        f"resulted in at least {at_least} tokens ({chars} characters). Please reduce the "
        f"length of the {where}.",
        param=where,
    )


class ImageFetchError(RenderError):
    """A remote image URL that is disabled, refused or could not be fetched."""

    status_code = 422
    code = "image_fetch_failed"


class TemplateError(RenderError):
    """The chat template failed (for example its own raise_exception for a bad conversation)."""

    code = "template_error"
