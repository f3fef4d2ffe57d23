"""The gateway's request models: the shared ones (cachekey/openai/protocol.py) on the fields the
gateway checks before routing. Unknown fields are allowed and forwarded to the worker as sent.

The sampling fields and their bounds are the worker's too (cachekey/openai/protocol.py
`SamplingFields`, vLLM's bounds); the worker adds what its engine runs (worker/server/protocol.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, field_validator

from cachekey.openai.protocol import (
    Bool,
    ChatFields,
    CompletionFields,
    Int,
    OpenAIRequest,
    SamplingFields,
    Str,
)


class _Envelope(OpenAIRequest):
    """What the gateway reads of a request beside its sampling fields."""

    model_config = ConfigDict(extra="allow")

    model: Str | None = None
    stream: Bool | None = False
    stream_options: dict[str, Any] | None = None
    cache_salt: Str | None = None


class _Request(SamplingFields, _Envelope):
    user: Str | None = None

    @field_validator("stream")
    @classmethod
    def _null_stream(cls, v: bool | None) -> bool:
        return bool(v)

    @field_validator("stream_options")
    @classmethod
    def _usage_is_bool(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and not isinstance(v.get("include_usage", False), bool):
            raise ValueError("stream_options.include_usage must be a boolean")
        return v


class ChatCompletionRequest(ChatFields, _Request):
    logprobs: Bool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=20)


class CompletionRequest(CompletionFields, _Request):
    logprobs: Int | None = Field(None, ge=0, le=5)
