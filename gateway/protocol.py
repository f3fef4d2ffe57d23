"""Request models (pydantic; unknown fields allowed and forwarded) and OpenAI error bodies.

Known fields are typed strictly, as OpenAI types them: a string, a boolean or a decimal number
(`64.0`) where an integer belongs is a 400 (`Invalid type for 'n': expected an integer, but got
a string instead.`, code `invalid_type`), never coerced, so a limit checked on integers cannot be
passed by sending another type. A number field takes integers and decimals, not booleans or
strings. `null` is "not set" for every optional field. The worker's request models
(worker/server/protocol.py) use the same types.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator

from cachekey.openai_errors import clean_message

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


_JSON_KINDS = ((bool, "a boolean"), (int, "an integer"), (float, "a decimal number"),
               (str, "a string"), (list, "an array"), (dict, "an object"))  # fmt: skip
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
}
_BOUNDS = {  # pydantic error type -> (wording, comparison, ctx key, code part)
    "greater_than_equal": ("below minimum", ">=", "ge", "below_min"),
    "greater_than": ("below minimum", ">", "gt", "below_min"),
    "less_than_equal": ("above maximum", "<=", "le", "above_max"),
    "less_than": ("above maximum", "<", "lt", "above_max"),
}


def json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for t, name in _JSON_KINDS if isinstance(value, t)), "a value")


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def invalid_request(exc: ValidationError) -> tuple[str, str | None, str]:
    """(message, param, code) of a validation error, worded as OpenAI words them."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None, "invalid_request"
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    siblings = [e for e in errors if tuple(e.get("loc", ()))[:1] == loc[:1]]
    if len(siblings) > 1 and len(loc) >= 2 and isinstance(loc[1], str):
        # A union ("stop": a string or an array of strings): pydantic names each branch.
        deepest = max(siblings, key=lambda e: len(e["loc"]))
        if len(deepest["loc"]) > 2:  # right container, wrong element: name the element
            return _describe(deepest, (loc[0], *deepest["loc"][2:]))
        field = _param(loc[:1])
        options = ", ".join(dict.fromkeys(str(e["loc"][1]) for e in siblings))
        got = json_kind(first.get("input"))
        msg = f"Invalid type for '{field}': expected one of {options}, but got {got} instead."
        return msg, field, "invalid_type"
    return _describe(first, loc)


# What pydantic says when the body is not an object at all.
_NOT_AN_OBJECT = frozenset({"model_type", "model_attributes_type", "dict_type"})


def _describe(error: Any, loc: tuple[Any, ...]) -> tuple[str, str | None, str]:
    kind, value = error.get("type", ""), error.get("input")
    if not loc and kind in _NOT_AN_OBJECT:
        got = json_kind(value)
        return f"The request body must be a JSON object, not {got}.", None, "invalid_type"
    if not loc:  # a rule over several fields (a model validator)
        return clean_message(error.get("msg", "invalid request")), None, "invalid_value"
    param = _param(loc)
    if kind in _EXPECTED:
        expected, got = _EXPECTED[kind], json_kind(value)
        msg = f"Invalid type for '{param}': expected {expected}, but got {got} instead."
        return msg, param, "invalid_type"
    if kind in _BOUNDS:
        side, op, key, code = _BOUNDS[kind]
        number = "integer" if isinstance(value, int) else "decimal"
        bound = (error.get("ctx") or {}).get(key)
        msg = (
            f"Invalid '{param}': {number} {side} value. Expected a value {op} {bound}, "
            f"but got {value} instead."
        )
        return msg, param, f"{number}_{code}_value"
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
    return f"Invalid value for '{param}': {error.get('msg', 'invalid')}.", param, "invalid_value"
