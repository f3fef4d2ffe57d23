"""The request models' base and strict field types, and the fields chat and completions share.

Known fields are typed strictly, as OpenAI types them: a string, a boolean or a decimal number
(`64.0`) where an integer belongs is a 400 (`Invalid type for 'n': expected an integer, but got
a string instead.`, code `invalid_type`; cachekey/openai/validation.py), never coerced, so a limit
checked on integers cannot be passed by sending another type. A number field takes integers and
decimals, not booleans or strings. `null` is "not set" for every optional field.

Each side subclasses these with its own base (its envelope fields, what it does with unknown
fields) around the one `SamplingFields`: gateway/protocol.py and worker/server/protocol.py, as
`class ChatCompletionRequest(ChatFields, SideBase)`. Pydantic orders the fields from the last
base to the first, so the side's base fields and the sampling fields are validated (and the
first error reported) before these.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict

Int = Annotated[int, Strict()]
Number = Annotated[float, Strict()]  # strict float still takes a JSON integer
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A token id: past int64 the worker could not pass it to its engine core (msgpack), a 500.
TokenId = Annotated[int, Strict(), Field(ge=0, le=INT64_MAX)]
MAX_N = 16384  # vLLM's default VLLM_MAX_N_SEQUENCES


class OpenAIRequest(BaseModel):
    """Every request model's base: strict, so no field is coerced from another JSON type."""

    model_config = ConfigDict(strict=True)


class SamplingFields(OpenAIRequest):
    """The sampling fields chat and completions share, declared once for the gateway and the
    worker, with the bounds vLLM checks (its protocol and `SamplingParams._verify_args`): `n` in
    [1, 16384], `seed` an int64, `temperature` in [0, 2], `top_p` in (0, 1], `top_k` -1 or more
    (0 and -1: off), the penalties in [-2, 2]. The gateway's `--max-n` bounds `n` further.
    `top_k` and each of `stop_token_ids` are also at most an int64 (`stop_token_ids` at least 0):
    the worker sends them to its engine core as msgpack, which has no larger integer, so
    `top_k: 18446744073709551616` was a 500 there, and three of them ejected every replica."""

    n: Int | None = Field(1, ge=1, le=MAX_N)
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    temperature: Number | None = Field(None, ge=0.0, le=2.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1, le=INT64_MAX)
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    stop: Str | list[Str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: Bool | None = False


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
