"""History, fork and replay, trajectory comparison, drift checks and corrupt checkpoints."""

from __future__ import annotations

import copy
import itertools
import json
import logging
from collections.abc import Callable
from typing import Any, Literal, cast

import psycopg
import pytest

from producer import compare_trajectories
from producer.client import Client
from producer.trajectories import Drift
from store import errors
from store.records import Message
from tests.support import services
from tests.support.driver import Driver, postgres
from worker import Agent, Tool, ToolContext, tool
from worker.providers import MockModel
from worker.steps import Outcome

calls: list[str] = []


@tool
def weather(city: str, ctx: ToolContext) -> str:
    """The weather of a city."""
    calls.append(ctx.tool_call_id)
    return f"sunny in {city}"


@tool(needs_approval=True)
def book(city: str) -> str:
    """Book a trip."""
    calls.append(f"book {city}")
    return f"booked {city}"


def _planner(
    model_id: str = "mock",
    instructions: str = "Plan trips.",
    tools: tuple[Tool, ...] = (weather, book),
    drift: Literal["warn", "error", "ignore"] = "warn",
) -> Agent:
    def script(messages: list[Message]) -> Any:
        turn = sum(1 for m in messages if m.role == "assistant")
        last_user = [m.content for m in messages if m.role == "user"][-1]
        if turn == 0:
            return {"tool_calls": [{"name": "weather", "args": {"city": "Oslo"}}]}
        if "rain" in str(last_user):
            return "Pack an umbrella."
        results = [m.content for m in messages if m.role == "tool"]
        return f"Plan based on: {results[-1]}"

    return Agent(
        name="planner",
        model=MockModel(script, model_id=model_id),
        instructions=instructions,
        tools=list(tools),
        on_agent_drift=drift,
    )


@pytest.fixture(autouse=True)
def _reset() -> None:
    calls.clear()


def _finished_trip(make_driver, client: Client, agent: Agent | None = None):  # type: ignore[no-untyped-def]
    driver = make_driver(agent or _planner())
    run = client.agent("planner").send("Plan my trip", session_id="trip")
    driver.drain("trip")
    return driver, run.wait(timeout=5)


def test_history_lists_each_save_newest_first(make_driver: Callable[..., Driver], client: Client) -> None:
    _, _result = _finished_trip(make_driver, client)
    entries = client.agent("planner").history("trip")
    assert [e.step for e in entries] == [2, 1, 1]
    assert entries[0].status == "finished" and entries[-1].status == "in-progress"
    assert entries[0].saved_at >= entries[-1].saved_at
    assert [e.step for e in client.agent("planner").history("trip", limit=1)] == [2]
    assert client.agent("planner").history("no-such-run") == []


def test_fork_from_a_step_with_appended_input_leaves_the_source_untouched(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver, original = _finished_trip(make_driver, client)
    planner = client.agent("planner")
    fork = planner.fork("trip", from_step=1, patch={"append_input": "It will rain, plan for that."})
    assert fork.session_id == "trip.fork-1" and fork.step == 1 and fork.checkpoint.status == "in-progress"
    assert client.store.load("trip").messages == original.messages  # type: ignore[union-attr]
    run = planner.resume(fork.session_id)
    assert run is not None
    driver.drain(fork.session_id)
    replayed = run.wait(timeout=5)
    assert replayed.text == "Pack an umbrella."
    assert planner.fork("trip", from_step=1).session_id == "trip.fork-2"
    comparison = compare_trajectories(client.store.load("trip"), client.store.load(fork.session_id))  # type: ignore[arg-type]
    assert comparison.diverged_at == 2 and len(comparison.a) == len(comparison.b) == 2
    assert comparison.drift.tool_order == [] and comparison.drift.step_count is None


def test_fork_patches_a_tool_result_in_place_and_replaces_business_state(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    _driver, _ = _finished_trip(make_driver, client)
    planner = client.agent("planner")
    fork = planner.fork(
        "trip",
        from_step=2,
        new_session_id="trip-b",
        patch={
            "tool_result": {"tool_call_id": "call_0_0", "result": {"forecast": "storm"}},
            "business_state": {"budget": 10},
        },
    )
    tool_messages = [m for m in fork.checkpoint.messages if m.role == "tool"]
    assert json.loads(tool_messages[0].content) == {"forecast": "storm"}
    assert tool_messages[0].tool_call_id == "call_0_0" and tool_messages[0].name == "weather"
    assert fork.checkpoint.business_state == {"budget": 10}
    with pytest.raises(errors.ConfigurationError):
        planner.fork("trip", from_step=1, new_session_id="trip-b")
    assert len(calls) == 1


def test_forking_an_unkept_step_lists_the_steps_kept(make_driver: Callable[..., Driver], client: Client) -> None:
    _finished_trip(make_driver, client)
    with pytest.raises(errors.CheckpointNotFoundError) as caught:
        client.agent("planner").fork("trip", from_step=7)
    assert caught.value.code == "LOUSHO_CHECKPOINT_NOT_FOUND" and "1, 2" in str(caught.value)


def test_a_fork_of_a_paused_entry_asks_for_a_new_approval(make_driver: Callable[..., Driver], client: Client) -> None:
    agent = Agent(
        name="planner",
        model=MockModel([{"tool_calls": [{"name": "book", "args": {"city": "Rome"}}]}, "done"]),
        tools=[book],
    )
    driver = make_driver(agent)
    client.agent("planner").send("Book Rome", session_id="trip")
    driver.drain("trip")
    original = client.store.load("trip")
    assert original is not None and original.status == "awaiting-approval"
    fork = client.agent("planner").fork("trip", from_step=1)
    assert fork.checkpoint.approval_ids == []
    client.agent("planner").resume(fork.session_id)
    driver.drain(fork.session_id)
    forked = client.store.load(fork.session_id)
    assert forked is not None and forked.status == "awaiting-approval"
    assert forked.approval_ids and forked.approval_ids != original.approval_ids
    assert calls == []


def test_compare_trajectories_reports_tool_order_arguments_and_length() -> None:
    a = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"id": "1", "name": "x", "args": {"n": 1}}]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"},
        {"role": "assistant", "content": "end"},
    ]
    b = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"id": "9", "name": "x", "args": {"n": 2}}]},
        {"role": "tool", "tool_call_id": "9", "content": "ok"},
        {"role": "assistant", "tool_calls": [{"id": "8", "name": "y", "args": {}}]},
        {"role": "tool", "tool_call_id": "8", "content": "ok"},
        {"role": "assistant", "content": "end"},
    ]
    result = compare_trajectories(cast(list[dict[str, Any]], a), cast(list[dict[str, Any]], b))
    assert result.diverged_at == 1
    assert result.drift.arguments == [{"step": 1, "tool": "x", "a": {"n": 1}, "b": {"n": 2}}]
    assert result.drift.tool_order == [{"step": 2, "a": [], "b": ["y"]}]
    assert result.drift.step_count == {"a": 2, "b": 3}


def _id_minting_planner() -> Agent:
    """The planner with a model that, like a real provider, mints fresh tool call ids for every turn."""
    minted = itertools.count(1)

    def script(messages: list[Message]) -> str | dict[str, Any]:
        if not any(m.role == "assistant" for m in messages):
            return {
                "tool_calls": [
                    {"id": f"call_{next(minted):04d}", "name": "weather", "args": {"city": city}}
                    for city in ("Oslo", "Rome")
                ]
            }
        return "Plan based on: " + ", ".join(str(m.content) for m in messages if m.role == "tool")

    return Agent(name="planner", model=MockModel(script), instructions="Plan trips.", tools=[weather])


def _changed(messages: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    """``messages`` with one thing other than an id changed in the first turn (or its results)."""
    changed = copy.deepcopy(messages)
    turn = next(m for m in changed if m["role"] == "assistant")
    if what == "text":
        changed[-1]["content"] += "!"
    elif what == "tool":
        turn["tool_calls"][1]["name"] = "book"
    elif what == "arguments":
        turn["tool_calls"][1]["args"] = {"city": "Lima"}
    else:
        next(m for m in changed if m["role"] == "tool")["content"] = "rain in Oslo"
    return changed


def _with_ids(messages: list[dict[str, Any]], ids: dict[str, str]) -> list[dict[str, Any]]:
    """``messages`` with each tool call id replaced through ``ids``."""
    renamed = copy.deepcopy(messages)
    for message in renamed:
        for call in message.get("tool_calls") or ():
            call["id"] = ids[call["id"]]
        if "tool_call_id" in message:
            message["tool_call_id"] = ids[message["tool_call_id"]]
    return renamed


def test_two_runs_that_differ_only_in_ids_have_the_same_trajectory(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(_id_minting_planner())
    for session_id in ("trip-a", "trip-b"):
        client.agent("planner").send("Plan my trip", session_id=session_id)
        driver.drain(session_id)
    a, b = client.store.load("trip-a"), client.store.load("trip-b")
    assert a is not None and b is not None and a.status == b.status == "finished"
    ids_a, ids_b = ([c.id for m in run.messages for c in m.tool_calls or ()] for run in (a, b))
    dumped_a, dumped_b = [m.dump() for m in a.messages], [m.dump() for m in b.messages]
    # Two separate runs whose transcripts differ in their call ids, and in nothing else.
    assert len(ids_a) == 2 and set(ids_a).isdisjoint(ids_b) and dumped_a != dumped_b
    assert _with_ids(dumped_b, dict(zip(ids_b, ids_a, strict=True))) == dumped_a
    same = compare_trajectories(a, b)
    print(f"runs with calls {ids_a} and {ids_b}: diverged_at {same.diverged_at}, drift {same.drift}")
    assert same.diverged_at is None and same.drift == Drift()
    # Anything but an id still counts.
    for what in ("text", "tool", "arguments", "result"):
        assert compare_trajectories(dumped_a, _changed(dumped_b, what)).diverged_at is not None, what


def _interrupted_after_model_turn(make_driver, client: Client, agent: Agent):  # type: ignore[no-untyped-def]
    driver = make_driver(agent)
    run = client.agent("planner").send("Plan my trip", session_id="trip")
    driver.queue.append(("trip", None))
    assert driver.drain(limit=1) == [Outcome.ADVANCED]
    driver.queue.clear()
    return run


def test_a_changed_agent_warns_and_continues_by_default(
    make_driver: Callable[..., Driver], client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    run = _interrupted_after_model_turn(make_driver, client, _planner())
    changed = make_driver(_planner(model_id="mock-2", instructions="Plan cheap trips."))
    with caplog.at_level(logging.WARNING, logger="lousho.drift"):
        changed.drain("trip")
    assert run.wait(timeout=5).finish_reason == "stop"
    (record,) = [r for r in caplog.records if r.name == "lousho.drift"]
    assert "model mock -> mock-2" in record.getMessage() and "instructions changed" in record.getMessage()
    assert "Plan cheap" not in record.getMessage()  # prompts are never logged


def test_a_changed_agent_with_drift_error_refuses_and_leaves_the_checkpoint(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    run = _interrupted_after_model_turn(make_driver, client, _planner())
    before = client.store.load("trip")
    strict = make_driver(_planner(model_id="mock-2", drift="error"))
    assert strict.drain("trip") == [Outcome.PARKED]
    with pytest.raises(errors.AgentDriftError) as caught:
        run.wait(timeout=2)
    assert "model mock -> mock-2" in str(caught.value)
    after = client.store.load("trip")
    assert after is not None and before is not None
    assert after.messages == before.messages and after.seq == before.seq and calls == []


def test_drift_error_puts_a_decided_approval_back_for_the_right_agent(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    gated = Agent(
        name="planner",
        model=MockModel([{"tool_calls": [{"name": "book", "args": {"city": "Rome"}}]}, "booked"]),
        tools=[book],
    )
    driver = make_driver(gated)
    paused = client.agent("planner").send("Book", session_id="trip")
    driver.drain("trip")
    approval_id = paused.wait(timeout=2).approval_id
    strict = make_driver(
        Agent(name="planner", model=MockModel(["x"], model_id="other"), tools=[book], on_agent_drift="error")
    )
    client.agent("planner").approvals.resolve(approval_id, approved=True)  # type: ignore[arg-type]
    assert strict.drain("trip") == [Outcome.PARKED]
    assert [a.approval_id for a in client.agent("planner").approvals.list()] == [approval_id]
    assert client.store.load("trip").status == "awaiting-approval"  # type: ignore[union-attr]
    run = client.agent("planner").approvals.resolve(approval_id, approved=True)  # type: ignore[arg-type]
    driver.drain("trip")
    assert run.wait(timeout=5).text == "booked" and calls == ["book Rome"]


def test_a_pending_call_whose_tool_was_removed_fails_whatever_the_drift_option(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    run = _interrupted_after_model_turn(make_driver, client, _planner())
    without = make_driver(_planner(tools=(book,), drift="ignore"))
    assert without.drain("trip") == [Outcome.PARKED]
    with pytest.raises(errors.ResumeToolMissingError):
        run.wait(timeout=2)


def test_a_checkpoint_without_fingerprint_resumes_without_a_warning(
    make_driver: Callable[..., Driver], client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    run = _interrupted_after_model_turn(make_driver, client, _planner())
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        conn.execute("UPDATE runs SET document = document - 'fingerprint'")
    changed = make_driver(_planner(model_id="brand-new", drift="error"))
    with caplog.at_level(logging.WARNING, logger="lousho.drift"):
        changed.drain("trip")
    assert run.wait(timeout=5).finish_reason == "stop" and caplog.records == []


def test_a_corrupt_checkpoint_is_parked_listed_refused_and_deletable(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    run = _interrupted_after_model_turn(make_driver, client, _planner())
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        conn.execute("""UPDATE runs SET document = '{"messages": 42}'""")
    driver = make_driver(_planner())
    assert driver.drain("trip") == [Outcome.PARKED]
    (pending,) = client.agent("planner").pending()
    assert pending.status == "in-progress" and pending.last_error is not None
    assert pending.last_error.code == "LOUSHO_CHECKPOINT_CORRUPT" and not pending.last_error.retryable
    with pytest.raises(errors.CheckpointCorruptError):
        client.agent("planner").send("more", session_id="trip")
    with pytest.raises(errors.CheckpointCorruptError):
        client.agent("planner").resume("trip")
    with pytest.raises(errors.CheckpointCorruptError):
        run.wait(timeout=1)
    assert postgres(client.store).stale_runs(0) == []
    assert client.agent("planner").delete("trip")
    assert client.agent("planner").pending() == []
