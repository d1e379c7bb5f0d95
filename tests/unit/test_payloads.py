"""Values that reach a checkpoint are made safe for Postgres JSON; untrusted JSON is parsed with limits."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from store import errors, payloads
from store.records import LastError


def _nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# -- sanitize ------------------------------------------------------------------------------------


def test_nul_is_replaced_in_strings_and_keys() -> None:
    assert payloads.sanitize({"k\x00": ["a\x00b", ("\x00",)]}) == {"k\ufffd": ["a\ufffdb", ["\ufffd"]]}


@pytest.mark.parametrize(("value", "expected"), [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")])
def test_non_finite_floats_become_strings(value: float, expected: str) -> None:
    assert payloads.sanitize({"x": value}) == {"x": expected}
    payloads.dumps(payloads.sanitize({"x": value}))  # strict JSON accepts the result


def test_a_huge_integer_becomes_text_instead_of_failing() -> None:
    # Python refuses str() of an int over 4300 digits, and Postgres would choke on the number.
    huge = 10**5000
    cleaned = payloads.sanitize({"n": huge, huge: "key", "list": [huge]})
    assert isinstance(cleaned["n"], str) and isinstance(cleaned["list"][0], str)
    assert all(isinstance(key, str) for key in cleaned)
    payloads.dumps(cleaned)


def test_a_large_integer_under_the_digit_limit_is_cut_to_the_cap() -> None:
    cleaned = payloads.sanitize(10**2000)
    assert cleaned == "1" + "0" * (payloads.MAX_INT_DIGITS - 1)


def test_small_integers_floats_bools_and_none_are_kept() -> None:
    value = {"i": -(2**63), "f": 0.1, "t": True, "n": None}
    assert payloads.sanitize(value) == value


def test_deep_nesting_is_cut_to_text_without_recursion_errors() -> None:
    cleaned = payloads.sanitize(_nested(10_000))
    payloads.dumps(cleaned)
    payloads.check_depth(cleaned, payloads.MAX_DEPTH + 1)


def test_a_self_referencing_value_is_cut_to_text() -> None:
    loop: list[Any] = []
    loop.append(loop)
    payloads.dumps(payloads.sanitize(loop))


def test_unknown_objects_become_their_text_and_models_their_json() -> None:
    class Odd:
        def __str__(self) -> str:
            return "odd\x00"

    assert payloads.sanitize(Odd()) == "odd\ufffd"
    assert payloads.sanitize(LastError(code="X")) == {"code": "X", "message": "", "retryable": False}


_JSON_LIKE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=30,
)


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [*value, *(s for v in value.values() for s in _strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


@given(_JSON_LIKE)
def test_anything_sanitized_serializes_as_strict_json_without_nul(value: Any) -> None:
    text = payloads.dumps(payloads.sanitize(value))  # strict: raises on NaN or Infinity
    assert not any("\x00" in s for s in _strings(json.loads(text)))


# -- tool results ----------------------------------------------------------------------------------


def test_a_tool_result_string_keeps_its_text_with_nul_replaced() -> None:
    assert payloads.tool_result_text("a\x00b") == "a\ufffdb"


def test_a_ten_megabyte_tool_result_is_truncated_with_a_marker() -> None:
    text = payloads.tool_result_text("x" * 10_000_000)
    assert text.startswith("x" * payloads.MAX_TOOL_RESULT)
    assert text[payloads.MAX_TOOL_RESULT :] == payloads.TRUNCATION_MARK.format(
        dropped=10_000_000 - payloads.MAX_TOOL_RESULT, total=10_000_000
    )


def test_a_structured_tool_result_becomes_strict_json_text() -> None:
    text = payloads.tool_result_text({"ok": True, "ratio": math.nan, "note": "\x00"})
    assert json.loads(text) == {"ok": True, "ratio": "nan", "note": "\ufffd"}


# -- untrusted JSON ----------------------------------------------------------------------------------


def test_json_ten_thousand_levels_deep_is_refused_as_too_large() -> None:
    with pytest.raises(errors.InputTooLargeError):
        payloads.loads_untrusted("[" * 10_000 + "]" * 10_000)


def test_json_just_over_the_depth_limit_is_refused() -> None:
    with pytest.raises(errors.InputTooLargeError):
        payloads.loads_untrusted(json.dumps(_nested(payloads.MAX_DEPTH + 2)))
    assert payloads.loads_untrusted(json.dumps(_nested(payloads.MAX_DEPTH - 1))) == _nested(payloads.MAX_DEPTH - 1)


@pytest.mark.parametrize("text", ['{"x": NaN}', "[Infinity]", "-Infinity"])
def test_json_nan_and_infinity_are_refused(text: str) -> None:
    with pytest.raises(errors.InputTooLargeError):
        payloads.loads_untrusted(text)


@pytest.mark.parametrize("text", ["not json", "{", "1" * 5000, b"\xff\xfe"])
def test_malformed_json_is_refused_with_a_typed_error(text: str | bytes) -> None:
    with pytest.raises(errors.InputTooLargeError):
        payloads.loads_untrusted(text)


def test_ordinary_json_parses_from_text_or_bytes() -> None:
    assert payloads.loads_untrusted(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
