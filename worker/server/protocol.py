"""The worker's request models: the shared ones (cachekey/openai/protocol.py) on the fields its
engine runs. Unknown fields are ignored: peer routers add their own.

A known field whose value asks for what this worker does not do (`response_format` JSON, a
required tool call, `logit_bias`, `echo`, `suffix`, `best_of` above `n`, logprobs, non-zero
penalties) is a 400 (`invalid_value`, `param` the field), so a client never takes free text for
what it asked. The neutral values SDKs send unasked (0, `{}`, `"text"`, `"auto"`) are accepted.
The gateway forwards all of these: the vLLM servers it also fronts honour them.

Strict as the gateway's are: "64" or 64.0 for an integer is a 400, never coerced; a number field
takes integers too; `null` means "not set". A body with a string holding a lone UTF-16 surrogate
(JSON `"\\ud800"`), which no tokenizer accepts, never reaches these models: the body guard
refuses it as the gateway does (worker/server/body_guard.py). Responses are built as plain dicts
in the serving handlers; only requests need validation.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from cachekey.openai.protocol import (
    Bool,
    ChatFields,
    CompletionFields,
    Int,
    OpenAIRequest,
    SamplingFields,
    Str,
)


def _not_done(what: str, instead: str) -> ValueError:
    return ValueError(f"{what} is not supported by this worker; {instead}")


class _Request(OpenAIRequest):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _Model(_Request):
    model: str | None = None


class EngineRequest(SamplingFields, _Model):
    """What chat and completions share that becomes engine SamplingParams: the one set of
    sampling fields (cachekey/openai/protocol.py), and the worker's own."""

    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's prefix-cache isolation: mixed into block 0's key, so it reaches every block.
    cache_salt: str | None = None
    logprobs: bool | int | None = None
    # SGLang's extension: each choice carries the hidden states of every token the model ran.
    return_hidden_states: bool = False
    # Declared only to be refused (see the module docstring): the engine does none of them.
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    echo: Bool | None = None

    @field_validator("n", "ignore_eos", "stream")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string when given")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | int | None) -> bool | int | None:
        if v:
            raise ValueError("logprobs are not supported by this worker")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v:  # bounds checked first (SamplingFields)
            raise _not_done(f"a non-zero {info.field_name}", "omit it or send 0")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") != "text":
            what = f"response_format {str(v.get('type'))[:64]!r}"
            raise _not_done(what, 'the output is free text: omit it or send {"type": "text"}')
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v:
            raise _not_done("logit_bias", "omit it or send {}")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise _not_done("echo", "omit it or send false")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(ChatFields, EngineRequest):
    """/v1/chat/completions: the shared chat fields on the engine's sampling fields."""

    # Tools are rendered into the prompt (cachekey/render.py) and the model's answer comes back
    # as text, never parsed into `tool_calls`: "none" and "auto" (the model may answer in text)
    # are what that gives; "required" or a named function would need a tool-call parser.
    tool_choice: Str | dict[str, Any] | None = None
    top_logprobs: Int | None = None

    @field_validator("tool_choice")
    @classmethod
    def _no_forced_tool(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if v is not None and v not in ("none", "auto"):
            what = "a named tool_choice" if isinstance(v, dict) else f"tool_choice {v[:64]!r}"
            raise _not_done(what, 'tool calls are not parsed: send "none" or "auto"')
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise _not_done("top_logprobs", "omit it or send 0")
        return v


class CompletionRequest(CompletionFields, EngineRequest):
    suffix: Str | None = None
    best_of: Int | None = Field(None, ge=1)  # after `n`, which it is checked against

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise _not_done("suffix", "omit it or send an empty string")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_ranking(cls, v: int | None, info: ValidationInfo) -> int | None:
        # best_of <= n returns every choice sampled, which is what n does; more would be ranked.
        if v is not None and v > (info.data.get("n") or 1):
            raise _not_done("best_of above n", "the n choices are sampled, not ranked: omit it")
        return v

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; a batch of several is refused with a clear message."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            p = p[0]
        if isinstance(p, list) and not p:
            raise ValueError("prompt must not be empty")
        return p


class TokenizeRequest(_Request):
    """vLLM's /tokenize: either `prompt` or chat `messages`."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
