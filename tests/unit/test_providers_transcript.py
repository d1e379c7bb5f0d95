"""Transcript conversion both ways, without a server: what we store survives each wire format."""

from __future__ import annotations

from typing import Any

import pytest

from store.records import Message, ToolCall
from worker.providers import _transcript
from worker.providers import anthropic as anthropic_wire
from worker.providers import openai as openai_wire

pytestmark = pytest.mark.usefixtures("no_real_providers")


def _transcript_with_everything() -> list[Message]:
    return [
        Message(role="system", content="You report the weather."),
        Message(role="user", content=[{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]),
        Message(
            role="assistant",
            content="Checking.",
            tool_calls=[
                ToolCall(id="call_a", name="lookup", args={"city": "Oslo", "days": [1, 2], "unit": None}),
                ToolCall(id="call_b", name="lookup", args={}),
            ],
        ),
        Message(role="tool", tool_call_id="call_a", name="lookup", content="sunny"),
        Message(
            role="tool",
            tool_call_id="call_b",
            name="lookup",
            is_error=True,
            content='{"error": "ToolArgsInvalid", "kind": "validation"}',
        ),
        Message(role="user", content="And tomorrow?"),
        Message(
            role="assistant",
            content=None,
            tool_calls=[
                ToolCall(id="call_c", name="lookup", args={}, invalid_args='{"city": "Oslo"'),
            ],
        ),
        Message(role="tool", tool_call_id="call_c", name="lookup", is_error=True, content="invalid JSON"),
        Message(role="assistant", content=[{"type": "text", "text": "Sunny "}, {"type": "text", "text": "both days."}]),
    ]


def test_openai_round_trip_keeps_everything_but_the_error_flag() -> None:
    messages = _transcript_with_everything()
    back = openai_wire.from_openai_messages(openai_wire.to_openai_messages(messages))
    assert back == [m.model_copy(update={"is_error": None}) for m in messages]


def test_anthropic_round_trip_keeps_everything() -> None:
    messages = _transcript_with_everything()
    system, wire = anthropic_wire.to_anthropic_messages(messages)
    back = anthropic_wire.from_anthropic_messages(system, wire)
    # A malformed call cannot be sent as such (input must be an object); its error result stays.
    expected = [
        m
        if not m.tool_calls or not m.tool_calls[0].invalid_args
        else m.model_copy(update={"tool_calls": [m.tool_calls[0].model_copy(update={"invalid_args": None})]})
        for m in messages
    ]
    assert back == expected


def test_openai_wire_shape_of_calls_and_results() -> None:
    wire = openai_wire.to_openai_messages(_transcript_with_everything())
    assert wire[0] == {"role": "system", "content": "You report the weather."}
    assert wire[2]["tool_calls"][0] == {
        "id": "call_a",
        "type": "function",
        "function": {"name": "lookup", "arguments": '{"city": "Oslo", "days": [1, 2], "unit": null}'},
    }
    assert wire[3] == {"role": "tool", "tool_call_id": "call_a", "content": "sunny"}
    assert wire[6] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_c", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Oslo"'}}
        ],
    }


def test_anthropic_puts_the_system_prompt_apart_and_merges_consecutive_results() -> None:
    system, wire = anthropic_wire.to_anthropic_messages(_transcript_with_everything())
    assert system == "You report the weather."
    assert [m["role"] for m in wire] == ["user", "assistant", "user", "user", "assistant", "user", "assistant"]
    assert wire[1]["content"] == [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_a", "name": "lookup", "input": {"city": "Oslo", "days": [1, 2], "unit": None}},
        {"type": "tool_use", "id": "call_b", "name": "lookup", "input": {}},
    ]
    assert wire[2]["content"] == [
        {"type": "tool_result", "tool_use_id": "call_a", "content": "sunny"},
        {
            "type": "tool_result",
            "tool_use_id": "call_b",
            "is_error": True,
            "content": '{"error": "ToolArgsInvalid", "kind": "validation"}',
        },
    ]
    assert wire[3] == {"role": "user", "content": "And tomorrow?"}


def test_anthropic_leaves_out_empty_text_and_joins_several_system_messages_as_blocks() -> None:
    messages = [
        Message(role="system", content="one"),
        Message(role="system", content="two"),
        Message(role="user", content="hi"),
        Message(role="assistant", content=""),
        Message(role="user", content=[{"type": "text", "text": ""}, {"type": "text", "text": "again"}]),
    ]
    system, wire = anthropic_wire.to_anthropic_messages(messages)
    assert system == [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert wire == [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "again"}]}]


def test_non_text_parts_and_non_string_content_pass_through() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}
    messages = [
        Message(role="user", content=["look", image]),
        Message(role="assistant", tool_calls=[ToolCall(id="c1", name="t")]),
        Message(role="tool", tool_call_id="c1", content={"temp": 21}),
    ]
    wire = openai_wire.to_openai_messages(messages)
    assert wire[0]["content"] == [{"type": "text", "text": "look"}, image]
    assert wire[2]["content"] == '{"temp": 21}'
    _, blocks = anthropic_wire.to_anthropic_messages(messages)
    assert blocks[2]["content"][0]["content"] == '{"temp": 21}'


def test_ids_other_apis_refuse_are_mapped_the_same_way_for_call_and_result() -> None:
    odd = "functions.lookup:0/with spaces and more than forty characters"
    messages = [
        Message(role="user", content="hi"),
        Message(role="assistant", tool_calls=[ToolCall(id=odd, name="lookup")]),
        Message(role="tool", tool_call_id=odd, content="ok"),
    ]
    wire = openai_wire.to_openai_messages(messages)
    assert wire[1]["tool_calls"][0]["id"] == wire[2]["tool_call_id"] != odd
    assert len(wire[2]["tool_call_id"]) <= 40
    _, blocks = anthropic_wire.to_anthropic_messages(messages)
    assert blocks[1]["content"][0]["id"] == blocks[2]["content"][0]["tool_use_id"] == wire[2]["tool_call_id"]


@pytest.mark.parametrize(
    ("raw", "args", "invalid"),
    [
        ('{"a": 1}', {"a": 1}, None),
        ("", {}, None),
        ("null", {}, None),
        (None, {}, None),
        ({"a": 1}, {"a": 1}, None),
        ('{"a": 1', {}, '{"a": 1'),
        ("[1, 2]", {}, "[1, 2]"),
        ("42", {}, "42"),
        (["x"], {}, '["x"]'),
    ],
)
def test_arguments_parse_to_an_object_or_are_kept_raw(raw: Any, args: dict[str, Any], invalid: str | None) -> None:
    assert _transcript.parse_arguments(raw) == (args, invalid)


def test_missing_and_reused_call_ids_are_replaced_deterministically() -> None:
    transcript = [
        Message(role="user", content="go"),
        Message(role="assistant", tool_calls=[ToolCall(id="call_0", name="t")]),
        Message(role="tool", tool_call_id="call_0", content="ok"),
    ]
    assert _transcript.assign_call_ids(["call_0", None, "", "call_9", "call_9"], transcript) == [
        "call_1_0",
        "call_1_1",
        "call_1_2",
        "call_9",
        "call_1_4",
    ]


def test_completion_parsing_reads_calls_usage_and_cache_tokens() -> None:
    body = {
        "model": "gpt-x-2025",
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "lookup", "arguments": '{"city": "Rome"}'},
                        },
                        {"id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": "{oops"}},
                    ],
                },
            }
        ],
        "usage": {
            "prompt_tokens": 120,
            "completion_tokens": 30,
            "total_tokens": 150,
            "prompt_tokens_details": {"cached_tokens": 100},
        },
    }
    response = openai_wire.parse_completion(body, [])
    assert response.text is None and response.finish_reason == "tool_calls" and response.model_id == "gpt-x-2025"
    assert response.tool_calls == [
        ToolCall(id="call_1", name="lookup", args={"city": "Rome"}),
        ToolCall(id="call_2", name="lookup", invalid_args="{oops"),
    ]
    assert (
        response.usage.input_tokens,
        response.usage.output_tokens,
        response.usage.total_tokens,
        response.usage.cache_read_tokens,
    ) == (120, 30, 150, 100)


def test_anthropic_usage_counts_cached_prompt_tokens_as_input() -> None:
    body = {
        "model": "claude-x",
        "stop_reason": "end_turn",
        "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "Sunny"},
            {"type": "text", "text": " today."},
        ],
        "usage": {
            "input_tokens": 20,
            "output_tokens": 7,
            "cache_read_input_tokens": 100,
            "cache_creation_input_tokens": 30,
        },
    }
    response = anthropic_wire.parse_message(body, [])
    assert response.text == "Sunny today." and response.tool_calls == []
    usage = response.usage
    assert (
        usage.input_tokens,
        usage.output_tokens,
        usage.total_tokens,
        usage.cache_read_tokens,
        usage.cache_write_tokens,
    ) == (150, 7, 157, 100, 30)


def test_a_refusal_is_the_turns_text() -> None:
    body = {"choices": [{"finish_reason": "stop", "message": {"content": None, "refusal": "I can't help."}}]}
    assert openai_wire.parse_completion(body, []).text == "I can't help."


def test_cache_points_mark_the_last_tool_system_block_and_message_block() -> None:
    system, wire = anthropic_wire.to_anthropic_messages(
        [Message(role="system", content="sys"), Message(role="user", content="hi")]
    )
    tools = [{"name": "a", "input_schema": {}}, {"name": "b", "input_schema": {}}]
    marked_system, marked_wire, marked_tools = anthropic_wire.mark_cache_points(system, wire, tools)
    ephemeral = {"type": "ephemeral"}
    assert marked_tools[1]["cache_control"] == ephemeral and "cache_control" not in marked_tools[0]
    assert marked_system == [{"type": "text", "text": "sys", "cache_control": ephemeral}]
    assert marked_wire == [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": ephemeral}]}]
    assert wire == [{"role": "user", "content": "hi"}] and "cache_control" not in tools[1]
