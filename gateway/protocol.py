"""Request models (pydantic; unknown fields allowed and forwarded).

Known fields are typed strictly, as OpenAI types them: a string, a boolean or a decimal number
(`64.0`) where an integer belongs is a 400 (`Invalid type for 'n': expected an integer, but got
a string instead.`, code `invalid_type`), never coerced, so a limit checked on integers cannot be
passed by sending another type. A number field takes integers and decimals, not booleans or
strings. `null` is "not set" for every optional field. The worker's request models
(worker/server/protocol.py) use the same types, and both word their validation errors with
cachekey/validation_errors.py.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator

Int = Annotated[int, Strict()]
Number = Annotated[float, Strict()]  # strict float still takes a JSON integer
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

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


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: Bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=20)

    def requested_max_tokens(self) -> int | None:
        """The output length the request asks for; None when it names none."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(_Request):
    prompt: Str | list[Int] | list[Str] | list[list[Int]]
    max_tokens: Int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: Int | None = Field(None, ge=0, le=5)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
