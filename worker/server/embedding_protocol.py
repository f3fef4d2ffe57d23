"""The /v1/embeddings request (OpenAI's, plus vLLM's chat-style `messages` for images).

kvgate extensions: `pooling` (`last`, the default, or `mean`), `normalize` (vLLM's name; L2,
on by default as OpenAI's embeddings are), `messages` instead of `input`, and `cache_salt`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from cachekey.openai.embeddings import EmbeddingFields, check_count
from worker.server.protocol import _Request


class EmbeddingRequest(EmbeddingFields, _Request):
    """The rules shared with the gateway are in cachekey/openai/embeddings.py."""

    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    pooling: Literal["last", "mean"] = "last"
    normalize: bool = True
    cache_salt: str | None = None
    user: str | None = None
    stream: bool = False

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string when given")
        return v

    def inputs(self) -> list[str | list[int]]:
        """The prompts to embed, one per output vector (empty ones refused)."""
        assert self.input is not None
        items = super().inputs()
        if not items:
            raise ValueError("input must not be an empty list")
        check_count(items)
        for i, item in enumerate(items):
            if not item:
                raise ValueError(f"input[{i}] is empty")
        return items
