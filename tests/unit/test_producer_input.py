"""What ``send`` accepts as input: a string or chat messages, within the input limits."""

from __future__ import annotations

import math
from typing import Any

import pytest

from store import errors, payloads
from store.inputs import MAX_INPUT_MESSAGES, normalize_input
from store.records import Message


def test_a_string_becomes_one_user_message() -> None:
    assert normalize_input("Charge and ship order 7") == [Message(role="user", content="Charge and ship order 7")]


def test_chat_dicts_and_message_records_are_accepted_in_order() -> None:
    messages = normalize_input(
        [
            {"role": "system", "content": "be brief"},
            Message(role="user", content="hi"),
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "name": "charge", "args": {"amount": 5}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok", "unknown_field": "ignored"},
        ]
    )
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2].tool_calls is not None and messages[2].tool_calls[0].args == {"amount": 5}


def test_an_empty_list_is_no_input() -> None:
    assert normalize_input([]) == []


def test_nul_and_nan_in_input_are_made_safe() -> None:
    (message,) = normalize_input([{"role": "user", "content": {"text": "a\x00b", "score": math.nan}}])
    assert message.content == {"text": "a\ufffdb", "score": "nan"}


def test_a_huge_integer_in_input_is_made_safe() -> None:
    (message,) = normalize_input([{"role": "user", "content": 10**5000}])
    assert isinstance(message.content, str)


def test_a_message_of_exactly_the_string_limit_is_accepted() -> None:
    (message,) = normalize_input("x" * payloads.MAX_INPUT_STRING)
    assert len(message.content) == payloads.MAX_INPUT_STRING


def test_a_message_over_the_string_limit_is_refused() -> None:
    with pytest.raises(errors.InputTooLargeError):
        normalize_input("x" * (payloads.MAX_INPUT_STRING + 1))


def test_more_messages_than_the_limit_are_refused() -> None:
    normalize_input([{"role": "user", "content": "x"}] * MAX_INPUT_MESSAGES)
    with pytest.raises(errors.InputTooLargeError):
        normalize_input([{"role": "user", "content": "x"}] * (MAX_INPUT_MESSAGES + 1))


def test_input_nested_past_the_depth_limit_is_refused() -> None:
    deep: Any = "leaf"
    for _ in range(10_000):
        deep = {"k": deep}
    with pytest.raises(errors.InputTooLargeError):
        normalize_input([{"role": "user", "content": deep}])


@pytest.mark.parametrize(
    "bad",
    [
        [{"role": "robot", "content": "hi"}],
        [{"content": "no role"}],
        ["just a string in a list"],
        [42],
        [{"role": "assistant", "tool_calls": [{"name": "no id"}]}],
    ],
)
def test_messages_without_the_chat_shape_are_a_configuration_error(bad: list[Any]) -> None:
    with pytest.raises(errors.ConfigurationError):
        normalize_input(bad)


@pytest.mark.parametrize("bad", [42, None, {"role": "user", "content": "a dict, not a list"}])
def test_input_that_is_neither_a_string_nor_a_list_is_a_configuration_error(bad: Any) -> None:
    with pytest.raises(errors.ConfigurationError):
        normalize_input(bad)
