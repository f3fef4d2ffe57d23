"""The gateway's request models: the shared ones (cachekey/openai/protocol.py) on the fields the
gateway checks before routing. Unknown fields are allowed and forwarded to the worker as sent.

`seed` is an int64 and the penalties lie in [-2, 2], as OpenAI's API bounds them; the worker
adds what its engine runs (worker/server/protocol.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, field_validator

from cachekey.openai.protocol import (
    INT64_MAX,
    INT64_MIN,
    Bool,
    ChatFields,
    CompletionFields,
    Int,
    Number,
    OpenAIRequest,
    Str,
)


class _Request(OpenAIRequest):
    model_config = ConfigDict(extra="allow")

    model: Str | None = None
    stream: Bool | None = False
    stream_options: dict[str, Any] | None = None
    cache_salt: Str | None = None
    n: Int | None = Field(None, ge=1)
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    temperature: Number | None = Field(None, ge=0.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = None
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    stop: Str | list[Str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: Bool | None = None
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
