"""A request model's validation errors worded as OpenAI words them, on both sides.

The gateway and the worker validate with the models of cachekey/openai/protocol.py (each side's
subclass); both turn pydantic's first error into the same `APIError` here, e.g. `Invalid
'temperature': decimal below minimum value. Expected a value >= 0, but got -1 instead.`
(`decimal_below_min_value`). Whether a bound is an integer's or a decimal's follows the field
(its bound's type), as OpenAI's does, not the value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cachekey.openai.errors import INVALID_VALUE, APIError, clean_message

INVALID_TYPE = "invalid_type"
MISSING_PARAMETER = "missing_required_parameter"

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
# What pydantic says when the body is not an object at all.
_NOT_AN_OBJECT = frozenset({"model_type", "model_attributes_type", "dict_type"})


def json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for t, name in _JSON_KINDS if isinstance(value, t)), "a value")


def _param(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The 400 of a request model's validation errors (pydantic's `errors()`, locations
    relative to the body)."""
    message, param, code = invalid_request(errors)
    return APIError(400, message, param=param, code=code)


def invalid_request(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None, str]:
    """(message, param, code) of a request model's validation errors (pydantic's `errors()`,
    locations relative to the body)."""
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
        return msg, field, INVALID_TYPE
    return _describe(first, loc)


def _describe(error: Mapping[str, Any], loc: tuple[Any, ...]) -> tuple[str, str | None, str]:
    kind, value = error.get("type", ""), error.get("input")
    if not loc and kind in _NOT_AN_OBJECT:
        got = json_kind(value)
        return f"The request body must be a JSON object, not {got}.", None, INVALID_TYPE
    if not loc:  # a rule over several fields (a model validator)
        return clean_message(error.get("msg", "invalid request")), None, INVALID_VALUE
    param = _param(loc)
    if kind in _EXPECTED:
        expected, got = _EXPECTED[kind], json_kind(value)
        msg = f"Invalid type for '{param}': expected {expected}, but got {got} instead."
        return msg, param, INVALID_TYPE
    if kind in _BOUNDS:
        side, op, key, code = _BOUNDS[kind]
        bound = (error.get("ctx") or {}).get(key)
        number = "decimal" if isinstance(bound, float) else "integer"
        shown = f"{bound:g}" if isinstance(bound, float) else bound
        msg = (
            f"Invalid '{param}': {number} {side} value. Expected a value {op} {shown}, "
            f"but got {value} instead."
        )
        return msg, param, f"{number}_{code}_value"
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param, MISSING_PARAMETER
    msg = f"Invalid value for '{param}': {clean_message(error.get('msg', 'invalid'))}."
    return msg, param, INVALID_VALUE
