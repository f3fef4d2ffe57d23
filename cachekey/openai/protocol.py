"""The request models' base and strict field types, and the fields chat and completions share.

Known fields are typed strictly, as OpenAI types them: a string, a boolean or a decimal number
(`64.0`) where an integer belongs is a 400 (`Invalid type for 'n': expected an integer, but got
a string instead.`, code `invalid_type`; cachekey/openai/validation.py), never coerced, so a limit
checked on integers cannot be passed by sending another type. A number field takes integers and
decimals, not booleans or strings. `null` is "not set" for every optional field.

Each side subclasses these with its own base (the sampling fields it checks, what it does with
unknown fields): gateway/protocol.py and worker/server/protocol.py, as
`class ChatCompletionRequest(ChatFields, SideBase)`. Pydantic orders the fields from the last
base to the first, so the side's sampling fields are validated (and the first error reported)
before these.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict

Int = Annotated[int, Strict()]
Number = Annotated[float, Strict()]  # strict float still takes a JSON integer
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class OpenAIRequest(BaseModel):
    """Every request model's base: strict, so no field is coerced from another JSON type."""

    model_config = ConfigDict(strict=True)


class ChatFields(OpenAIRequest):
    """/v1/chat/completions' own fields."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: Bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)

    def requested_max_tokens(self) -> int | None:
        """The output length the request asks for; None when it names none."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionFields(OpenAIRequest):
    """/v1/completions' own fields."""

    prompt: Str | list[Int] | list[Str] | list[list[Int]]
    max_tokens: Int | None = Field(16, ge=1)  # OpenAI's default for completions

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
