"""Agents and tools as configuration, and the scripted ``MockModel``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from store import errors
from store.records import Message, ToolCall
from worker import business
from worker.agents import Agent, Tool, ToolArgsInvalid, ToolContext, load_agents, tool
from worker.providers import MockModel

CONTEXT = ToolContext(tool_call_id="call_0_0", session_id="order-7", agent="shop", step=1, checkpoint_seq=3)


@tool
def charge(amount: float, ctx: ToolContext, currency: str = "EUR") -> str:
    """Charge the customer's card.

    Uses the call id as the idempotency key.
    """
    return f"{amount:.2f} {currency} key={ctx.tool_call_id} run={ctx.session_id} seq={ctx.checkpoint_seq}"


def _email(subject: str) -> str:
    return f"sent {subject}"


email = Tool(_email, name="email_team", description="Email everyone.", needs_approval=True)


@tool
async def lookup(order: int) -> dict[str, Any]:
    """Look an order up."""
    await asyncio.sleep(0)
    return {"order": order, "status": "shipped"}


# -- tools ---------------------------------------------------------------------------------------


def test_a_tool_input_schema_comes_from_its_signature_without_the_context() -> None:
    schema = charge.input_schema
    assert set(schema["properties"]) == {"amount", "currency"}
    assert schema["properties"]["amount"]["type"] == "number"
    assert schema["properties"]["currency"]["default"] == "EUR"
    assert schema["required"] == ["amount"]
    assert schema["additionalProperties"] is False


def test_a_tool_description_comes_from_its_docstring_unless_given() -> None:
    assert charge.description.startswith("Charge the customer's card.")
    assert "idempotency key" in charge.description
    assert (email.name, email.description) == ("email_team", "Email everyone.")
    spec = charge.spec()
    assert (spec.name, spec.description, spec.input_schema) == ("charge", charge.description, charge.input_schema)


def test_the_tool_context_is_injected_by_type_or_by_the_name_ctx() -> None:
    assert charge.invoke({"amount": 5}, CONTEXT) == "5.00 EUR key=call_0_0 run=order-7 seq=3"

    @tool
    def by_name(x: int, ctx) -> str:  # type: ignore[no-untyped-def]  # the unannotated ctx is the point
        return f"{x} {ctx.step}"

    assert "ctx" not in by_name.input_schema["properties"]
    assert by_name.invoke({"x": 2}, CONTEXT) == "2 1"


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({}, "amount"),
        ({"amount": "lots"}, "amount"),
        ({"amount": 5, "tip": 1}, "tip"),
        ({"amount": 5, "currency": ["EUR"]}, "currency"),
    ],
)
def test_arguments_that_do_not_match_the_schema_are_refused(args: dict[str, Any], problem: str) -> None:
    with pytest.raises(ToolArgsInvalid, match=problem):
        charge.invoke(args, CONTEXT)


def test_arguments_are_coerced_like_pydantic_does() -> None:
    assert charge.validate({"amount": "5.5"}) == {"amount": 5.5, "currency": "EUR"}


def test_an_async_tool_is_run_to_completion() -> None:
    assert lookup.is_async
    assert lookup.invoke({"order": 7}, CONTEXT) == {"order": 7, "status": "shipped"}


def test_approval_rules_are_a_flag_or_a_function_of_the_call() -> None:
    big_only = Tool(charge.fn, name="big", needs_approval=lambda args, ctx: args["amount"] > 100)
    assert email.requires_approval({"subject": "hi"}, CONTEXT)
    assert not charge.requires_approval({"amount": 500}, CONTEXT)
    assert big_only.requires_approval({"amount": 500}, CONTEXT)
    assert not big_only.requires_approval({"amount": 5}, CONTEXT)


def test_a_tool_is_still_callable_as_the_plain_function() -> None:
    assert email("hello") == "sent hello"


# -- agents ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"name": ""},
        {"max_steps": 0},
        {"tool_concurrency": 0},
        {"on_agent_drift": "panic"},
        {"tools": [charge, Tool(_email, name="charge")]},
    ],
)
def test_an_agent_with_unusable_settings_is_a_configuration_error(options: dict[str, Any]) -> None:
    settings: dict[str, Any] = {"name": "shop", "model": MockModel(["ok"]), **options}
    with pytest.raises(errors.ConfigurationError):
        Agent(**settings)


def test_the_fingerprint_is_stable_and_changes_with_a_tool_schema() -> None:
    first = Agent("shop", MockModel(["ok"]), instructions="sell", tools=[charge, email])
    same = Agent("shop", MockModel(["other"]), instructions="sell", tools=[email, charge])
    changed = Agent("shop", MockModel(["ok"]), instructions="sell", tools=[Tool(_email, name="charge"), email])
    assert first.fingerprint() == same.fingerprint()
    assert first.fingerprint()["hash"] != changed.fingerprint()["hash"]
    assert first.fingerprint()["model"] == "mock"


def test_agents_are_found_in_the_modules_named_by_the_settings() -> None:
    found = load_agents(["examples.shop"])
    assert "shop" in found and isinstance(found["shop"], Agent)


def test_a_module_that_cannot_be_imported_is_a_configuration_error() -> None:
    with pytest.raises(errors.ConfigurationError):
        load_agents(["no_such_module_for_lousho"])


# -- MockModel -------------------------------------------------------------------------------------

SCRIPT: list[Any] = [
    {"tool_calls": [{"name": "charge", "args": {"amount": 5}}, {"name": "email_team", "args": {"subject": "x"}}]},
    {"text": "Charged.", "usage": {"input_tokens": 7, "output_tokens": 2}},
]
TURN_0 = [Message(role="system", content="sell"), Message(role="user", content="Charge order 7")]
TURN_1 = [
    *TURN_0,
    Message(
        role="assistant",
        tool_calls=[
            ToolCall(id="call_0_0", name="charge", args={"amount": 5}),
            ToolCall(id="call_0_1", name="email_team", args={"subject": "x"}),
        ],
    ),
    Message(role="tool", tool_call_id="call_0_0", content="ok"),
    Message(role="tool", tool_call_id="call_0_1", content="ok"),
]


def test_the_response_is_chosen_by_the_number_of_assistant_turns() -> None:
    model = MockModel(SCRIPT)
    first = model.generate(TURN_0, [])
    assert [(c.id, c.name, c.args) for c in first.tool_calls] == [
        ("call_0_0", "charge", {"amount": 5}),
        ("call_0_1", "email_team", {"subject": "x"}),
    ]
    second = model.generate(TURN_1, [])
    assert (second.text, second.tool_calls) == ("Charged.", [])
    assert (second.usage.input_tokens, second.usage.output_tokens, second.usage.total_tokens) == (7, 2, 9)


def test_the_same_transcript_gets_the_same_answer_in_any_process() -> None:
    # A worker taking over from a crashed one builds its own model object and gets the same ids.
    assert MockModel(SCRIPT).generate(TURN_0, []) == MockModel(SCRIPT).generate(TURN_0, [])


def test_an_exhausted_script_is_a_non_retryable_provider_error() -> None:
    with pytest.raises(errors.ProviderError) as raised:
        MockModel(["only one"]).generate(
            [*TURN_0, Message(role="assistant", content="only one"), Message(role="user", content="more")], []
        )
    assert raised.value.retryable is False


def test_an_invalid_transcript_is_refused_before_the_script_is_asked() -> None:
    asked: list[int] = []

    def script(messages: list[Message]) -> str:
        asked.append(len(messages))
        return "answer"

    broken = [*TURN_1[:-1], Message(role="user", content="input between a call and its result")]
    with pytest.raises(errors.ProviderError, match="invalid transcript") as raised:
        MockModel(script).generate(broken, [])
    assert raised.value.retryable is False and asked == []


def test_a_callable_script_sees_the_transcript() -> None:
    model = MockModel(lambda messages: f"{len(messages)} messages")
    assert model.generate(TURN_0, []).text == "2 messages"


@pytest.mark.parametrize("retryable", [True, False])
def test_a_scripted_error_is_a_provider_error_with_its_retryability(retryable: bool) -> None:
    with pytest.raises(errors.ProviderError) as raised:
        MockModel([{"error": "503 from upstream", "retryable": retryable}]).generate(TURN_0, [])
    assert raised.value.retryable is retryable


def test_a_response_of_the_wrong_type_is_a_configuration_error() -> None:
    with pytest.raises(errors.ConfigurationError):
        MockModel([42]).generate(TURN_0, [])


def test_a_tool_context_lets_a_tool_write_the_business_state_only() -> None:
    ctx = ToolContext(tool_call_id="call_1", session_id="order-7", agent="shop", step=1, business_state={"n": 1})
    ctx.business_state = {"n": 2}
    assert ctx.business_state == {"n": 2}
    with pytest.raises(AttributeError, match=r"ToolContext\.tool_call_id is read-only"):
        ctx.tool_call_id = "call_2"
    reading = business.read_only(ToolContext(tool_call_id="call_1", session_id="order-7", agent="shop", step=1))
    with pytest.raises(AttributeError, match="cannot be written here"):
        reading.business_state = {"n": 3}


def test_a_write_is_what_differs_from_what_was_handed_and_must_be_json() -> None:
    before = {"items": [1]}
    handed = business.handed(before)
    handed["items"].append(2)  # in place: the original is untouched, and the change is a write
    assert before == {"items": [1]}
    assert business.written(before, handed, "tool") == business.Write({"items": [1, 2]}, "tool")
    assert business.written(before, {"items": [1]}, "tool") is None
    assert business.written(before, None, "tool") == business.Write(None, "tool")
    with pytest.raises(business.InvalidWrite, match="business_state must be JSON"):
        business.written(before, {"at": float("nan")}, "tool")
