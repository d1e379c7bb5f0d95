"""A run's business state as tools, hooks and sends write it: saved with what it goes with, one event per change,
seen by a fork of the step that wrote it and by ``describe``. Real services, steps in-process."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from producer.client import Client
from store import errors, runs
from store.records import Message
from tests.support.driver import Driver
from tests.support.state_agents import LEDGER, ledger
from worker import Agent, HookContext, ToolContext, tool
from worker.hooks import ModelRequest
from worker.providers import MockModel
from worker.steps import Outcome


def _changes(client: Client, session_id: str) -> list[dict[str, Any]]:
    return [e.data for e in client.read_events(session_id, -1) if e.type == "business_state.changed"]


def test_a_fork_sees_the_business_state_of_its_step(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(ledger)
    run = client.agent(LEDGER).send("run ledger-1", session_id="ledger-1")
    driver.drain("ledger-1")
    assert run.wait(timeout=5).text == "ledger done"
    assert client.agent(LEDGER).load("ledger-1").business_state == {"entries": ["a", "b"]}  # type: ignore[union-attr]

    first = client.agent(LEDGER).fork("ledger-1", from_step=1, new_session_id="ledger-1-fork")
    assert first.checkpoint.business_state == {"entries": ["a"]}
    assert client.agent(LEDGER).load("ledger-1-fork").business_state == {"entries": ["a"]}  # type: ignore[union-attr]
    second = client.agent(LEDGER).fork("ledger-1", from_step=2)
    assert second.checkpoint.business_state == {"entries": ["a", "b"]}
    # The fork runs on from its step's state: its next call appends to it.
    resumed = client.agent(LEDGER).resume("ledger-1-fork")
    assert resumed is not None
    driver.drain("ledger-1-fork")
    assert client.agent(LEDGER).load("ledger-1-fork").business_state == {"entries": ["a", "b"]}  # type: ignore[union-attr]


def test_send_sets_the_business_state_the_run_works_with(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(ledger)
    run = client.agent(LEDGER).send(
        "run ledger-2", session_id="ledger-2", business_state={"entries": ["opening"], "owner": "ops"}
    )
    driver.drain("ledger-2")
    run.wait(timeout=5)
    assert client.agent(LEDGER).load("ledger-2").business_state == {  # type: ignore[union-attr]
        "entries": ["opening", "a", "b"],
        "owner": "ops",
    }
    changes = _changes(client, "ledger-2")
    assert [c["by"] for c in changes] == ["send", "tool", "tool"]
    assert changes[0] == {"by": "send", "input_number": 1, "business_state": {"entries": ["opening"], "owner": "ops"}}
    assert changes[1]["tool_name"] == "record" and changes[1]["tool_call_id"].startswith("r0-")
    summary = client.describe("ledger-2")
    assert summary is not None and summary.business_state == {"entries": ["opening", "a", "b"], "owner": "ops"}


def test_send_refuses_a_business_state_it_could_not_save(client: Client) -> None:
    with pytest.raises(errors.ConfigurationError, match="business_state must be JSON"):
        client.agent(LEDGER).send("hello", session_id="ledger-3", business_state={"when": object()})
    with pytest.raises(errors.InputTooLargeError, match="business_state is at most"):
        client.agent(LEDGER).send(
            "hello", session_id="ledger-3", business_state={"blob": "x" * (runs.MAX_BUSINESS_STATE_BYTES + 1)}
        )
    with pytest.raises(errors.ConfigurationError, match="reserved"):
        client.agent(LEDGER).send("hello", session_id="ledger-3", metadata={"lousho.business_state": 1})
    assert client.agent(LEDGER).load("ledger-3") is None


class _Stamper:
    """Writes the business state around model and tool calls; tries to in on_run_end."""

    def __init__(self) -> None:
        self.end_error: str | None = None

    def pre_generate(self, ctx: HookContext, request: ModelRequest) -> None:
        ctx.business_state = {**(ctx.business_state or {}), "turns": (ctx.business_state or {}).get("turns", 0) + 1}

    def post_tool_call(self, ctx: HookContext, result: Message) -> None:
        ctx.business_state["checked"] = ctx.tool_name  # in place

    def on_run_end(self, ctx: HookContext, end: Any) -> None:
        try:
            ctx.business_state = {"lost": True}
        except AttributeError as exc:
            self.end_error = str(exc)


@tool
def noop(ctx: ToolContext) -> str:
    """Do nothing."""
    return "ok"


@tool
def bad_state(ctx: ToolContext) -> str:
    """Write a state that is not JSON."""
    ctx.business_state = {"at": {1, 2}}
    return "wrote"


def _two_calls(name: str) -> Callable[[list[Message]], Any]:
    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": name, "args": {}}]}
        return "done"

    return answer


def test_hooks_write_the_business_state_with_the_turn_and_the_result(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    stamper = _Stamper()
    agent = Agent(name="stamped", model=MockModel(_two_calls("noop")), tools=[noop], hooks=[stamper])
    driver = make_driver(agent)
    run = client.agent("stamped").send("go", session_id="stamped-1")
    driver.drain("stamped-1")
    run.wait(timeout=5)
    assert client.agent("stamped").load("stamped-1").business_state == {  # type: ignore[union-attr]
        "turns": 2,
        "checked": "noop",
    }
    changes = _changes(client, "stamped-1")
    assert [(c["by"], c.get("step"), c.get("tool_name")) for c in changes] == [
        ("hook", 1, None),
        ("hook", None, "noop"),
        ("hook", 2, None),
    ]
    assert stamper.end_error is not None and "cannot be written here" in stamper.end_error


def test_a_tool_that_writes_a_state_that_is_not_json_gets_an_error_result(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    agent = Agent(name="bad-state", model=MockModel(_two_calls("bad_state")), tools=[bad_state])
    driver = make_driver(agent)
    client.agent("bad-state").send("go", session_id="bad-state-1", business_state={"kept": True})
    assert driver.drain("bad-state-1")[-1] == Outcome.FINISHED
    stored = client.agent("bad-state").load("bad-state-1")
    assert stored is not None and stored.business_state == {"kept": True}
    (result,) = [m for m in stored.messages if m.role == "tool"]
    assert result.is_error and json.loads(str(result.content))["error"] == "BusinessStateInvalid"
