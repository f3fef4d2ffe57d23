"""Typed render errors: each carries the HTTP status and the request field it blames.

The gateway and the worker turn these into OpenAI-style error bodies, so the message must tell
the user what to change, not where the code failed.
"""

from __future__ import annotations


class RenderError(ValueError):
    """A request that cannot be rendered into a prompt."""

    status_code: int = 400
    error_type: str = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_dict(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": type(self).__name__,
            }
        }


class InvalidImageError(RenderError):
    """The image data is not valid base64, or not an image in a supported format."""


class ImageTooLargeError(RenderError):
    """The image (or its encoded form) exceeds the configured size limits."""

    status_code = 413


class UnsupportedContentError(RenderError):
    """A message shape, role or content-part type this model cannot take."""


class PromptTooLongError(RenderError):
    """The rendered prompt is longer than the model (or the configured limit) allows."""


class ImageFetchError(RenderError):
    """A remote image URL that is disabled, refused or could not be fetched."""

    status_code = 422


class TemplateError(RenderError):
    """The chat template failed (for example its own raise_exception for a bad conversation)."""
