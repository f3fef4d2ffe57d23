"""Request models (pydantic; unknown fields allowed and forwarded)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
