"""The worker's request models: the shared ones (cachekey/openai/protocol.py) on the fields its
engine runs. Unknown fields are ignored: peer routers add their own.

Strict as the gateway's are: "64" or 64.0 for an integer is a 400, never coerced; a number field
takes integers too; `null` means "not set". A string holding a lone UTF-16 surrogate (JSON
`"\\ud800"`), which no tokenizer accepts, is a 400 too. Responses are built as plain dicts in the
serving handlers; only requests need validation.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ConfigDict, ValidationInfo, field_validator, model_validator

from cachekey.openai.protocol import ChatFields, CompletionFields, OpenAIRequest, SamplingFields

_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins valid pairs: any left is lone


def has_lone_surrogate(value: Any) -> bool:
    """Whether any string (key or value) in a parsed JSON body holds a lone surrogate."""
    stack = [value]
    while stack:  # not recursive: a body nested hundreds deep must not raise RecursionError
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):  # isascii is O(1): big base64 is free
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


class _Request(OpenAIRequest):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        if has_lone_surrogate(data):
            raise ValueError("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff)")
        return data


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

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(ChatFields, EngineRequest):
    """/v1/chat/completions: the shared chat fields on the engine's sampling fields."""


class CompletionRequest(CompletionFields, EngineRequest):
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
