"""The raw-bytes JSON measure (cachekey/json_shape.py) against a plain reference lexer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachekey.json_shape import JSONShapeError, decode_json, measure_json

TEXT = st.text(alphabet=st.sampled_from('ab"\\[]{},: \n\u00e9\U0001f600'), max_size=12)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=40,
)


def reference(raw: str) -> tuple[int, int]:
    """(elements, depth) by walking the text one character at a time, as a lexer would."""
    inside = escaped = False
    depth = deepest = structural = 0
    for ch in raw:
        if inside:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                inside = False
        elif ch == '"':
            inside = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            structural += 1
        elif ch in "]}":
            depth -= 1
        elif ch in ",:":
            structural += 1
    return structural + 1, deepest


@settings(max_examples=400, deadline=None)
@given(value=VALUES, ascii_only=st.booleans(), indent=st.sampled_from([None, 1]))
def test_measure_matches_the_reference(value, ascii_only: bool, indent) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    assert measure_json(text.encode()) == reference(text)


def test_measure_across_chunk_boundaries(monkeypatch) -> None:
    """State (inside a string, depth) carries from one numpy chunk to the next."""
    import cachekey.json_shape as guard

    monkeypatch.setattr(guard, "_CHUNK", 7)
    text = json.dumps({"a": ['x, "y" [z]', [[{"b": "}"}]], "\\", {}]} | {"c": ["q"] * 9})
    assert measure_json(text.encode()) == reference(text)


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"[" * 65 + b"]" * 65, "json_too_deep"),
        (b'{"a":' * 65 + b"1" + b"}" * 65, "json_too_deep"),
        (b"[" + b"0," * 1000 + b"0]", "json_too_large"),
        (b'{"a": "\\ud800"}', "invalid_json"),
        (b'{"a": NaN}', "invalid_json"),
        (b'{"a": 1} trailing', "invalid_json"),
    ],
)
def test_refusals(raw: bytes, code: str) -> None:
    with pytest.raises(JSONShapeError) as info:
        decode_json(raw, 64, 1000)
    assert info.value.code == code


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"", "the body is empty"),
        (b" \r\n", "the body is empty"),
        ('{"a": 1}'.encode("utf-16"), "JSON is UTF-8"),
        ('{"a": 1}'.encode("utf-16-be"), "JSON is UTF-8"),
        ('{"a": 1}'.encode("utf-32-le"), "JSON is UTF-8"),
        (b'{"a": NaN}', "NaN and Infinity are not JSON numbers (byte 6)"),
        (b'{"a": -Infinity}', "NaN and Infinity are not JSON numbers (byte 7)"),
        (b'{"a": "\\ud800"}', "lone UTF-16 surrogate"),  # msgspec: "Input data was truncated"
        (b'{"a": "x\\udc00"}', "lone UTF-16 surrogate"),
        (b'{"a": "\\ud800', "Input data was truncated"),  # truncated after all
    ],
)
def test_a_refusal_names_what_json_forbids(raw: bytes, says: str) -> None:
    with pytest.raises(JSONShapeError) as info:
        decode_json(raw, 64, 1000)
    assert info.value.code == "invalid_json" and says in info.value.message


def test_a_utf8_byte_order_mark_is_skipped() -> None:
    assert decode_json(b'\xef\xbb\xbf{"a": "\\ud83d\\ude00"}', 64, 1000) == {"a": "\U0001f600"}


def test_structure_inside_strings_is_not_counted() -> None:
    raw = json.dumps({"text": "[" * 500 + ",:" * 5000}).encode()
    assert decode_json(raw, 64, 1000) == {"text": "[" * 500 + ",:" * 5000}
    assert decode_json(b"[" * 64 + b"]" * 64, 64, 1000) is not None
