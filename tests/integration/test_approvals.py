"""Approvals in the middle of a tool batch, decided later from another client, stepped in-process."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest

from producer.client import Client
from store import errors
from store.checkpoints import PostgresCheckpointStore
from store.settings import Settings
from tests.support.driver import Driver, postgres
from worker import Agent, ToolContext, tool
from worker.providers import MockModel
from worker.steps import Outcome

ran: list[tuple[str, str]] = []


@tool
def read_balance(account: str, ctx: ToolContext) -> str:
    """Read an account balance."""
    ran.append(("read_balance", ctx.tool_call_id))
    return f"{account}: 100"


@tool(needs_approval=True)
def transfer(amount: int, ctx: ToolContext) -> str:
    """Move money."""
    ran.append(("transfer", ctx.tool_call_id))
    return f"moved {amount}"


@tool(needs_approval=lambda args, ctx: args["amount"] > 50)
def refund(amount: int, ctx: ToolContext) -> str:
    """Refund a customer; large refunds need a human."""
    ran.append(("refund", ctx.tool_call_id))
    return f"refunded {amount}"


def _bank(script: list[Any]) -> Agent:
    return Agent(name="bank", model=MockModel(script), tools=[read_balance, transfer, refund])


FOUR_CALLS = {
    "tool_calls": [
        {"name": "read_balance", "args": {"account": "a"}},
        {"name": "transfer", "args": {"amount": 10}},
        {"name": "read_balance", "args": {"account": "b"}},
        {"name": "transfer", "args": {"amount": 20}},
    ]
}


@pytest.fixture(autouse=True)
def _reset() -> None:
    ran.clear()


def _paused(make_driver, client: Client, script: list[Any]):  # type: ignore[no-untyped-def]
    driver = make_driver(_bank(script))
    run = client.agent("bank").send("move money", session_id="b-1")
    driver.drain("b-1")
    return driver, run.wait(timeout=5)


def test_a_turn_runs_its_ungated_calls_and_pauses_once_on_every_gated_call(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    _, paused = _paused(make_driver, client, [FOUR_CALLS, "done"])
    assert paused.finish_reason == "awaiting-approval"
    assert len(paused.approval_ids) == 2 and paused.approval_id == paused.approval_ids[0]
    assert sorted(name for name, _ in ran) == ["read_balance", "read_balance"]
    listed = client.agent("bank").approvals.list()
    assert [(a.tool_name, a.args, a.tool_call_id) for a in listed] == [
        ("transfer", {"amount": 10}, "call_0_1"),
        ("transfer", {"amount": 20}, "call_0_3"),
    ]
    assert all(a.session_id == "b-1" and a.created_at is not None for a in listed)
    (pending,) = client.agent("bank").pending()
    assert pending.status == "awaiting-approval" and pending.approval_id == paused.approval_id
    assert pending.approval_kind == "tool"
    assert postgres(client.store).stale_runs(0) == []  # the sweep leaves paused runs alone


def test_sending_to_a_paused_run_is_refused_and_runs_nothing(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver, paused = _paused(make_driver, client, [FOUR_CALLS, "done"])
    with pytest.raises(errors.SessionAwaitingApprovalError) as caught:
        client.agent("bank").send("hurry up", session_id="b-1")
    assert caught.value.session_id == "b-1" and caught.value.approval_id == paused.approval_id
    with pytest.raises(errors.SessionAwaitingApprovalError):
        client.agent("bank").resume("b-1")
    assert driver.drain("b-1") == [Outcome.IDLE]
    assert len(ran) == 2


def test_deciding_each_approval_continues_the_run_with_results_in_call_order(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver, paused = _paused(make_driver, client, [FOUR_CALLS, "done"])
    first, second = paused.approval_ids
    approvals = client.agent("bank").approvals
    still = approvals.resolve(first, approved=True).wait(timeout=2)
    assert still.finish_reason == "awaiting-approval" and still.approval_ids == [first, second]
    assert driver.drain("b-1") == [Outcome.IDLE]
    run = approvals.resolve(second, approved=False, note="too much today")
    driver.drain("b-1")
    result = run.wait(timeout=5)
    assert result.finish_reason == "stop" and result.text == "done"
    tools = [m for m in result.messages if m.role == "tool"]
    assert [m.tool_call_id for m in tools] == ["call_0_0", "call_0_1", "call_0_2", "call_0_3"]
    assert tools[1].content == "moved 10"
    rejection = json.loads(tools[3].content)
    assert rejection["kind"] == "rejected" and rejection["note"] == "too much today" and tools[3].is_error
    assert [name for name, _ in ran].count("transfer") == 1
    assert approvals.list() == []


def test_an_approval_rule_can_clear_small_calls_and_gate_large_ones(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    script = [
        {"tool_calls": [{"name": "refund", "args": {"amount": 5}}, {"name": "refund", "args": {"amount": 500}}]},
        "ok",
    ]
    _, paused = _paused(make_driver, client, script)
    assert paused.finish_reason == "awaiting-approval" and len(paused.approval_ids) == 1
    assert ran == [("refund", "call_0_0")]


def test_a_gated_call_in_a_later_turn_pauses_again_with_a_new_approval(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    script = [
        {"tool_calls": [{"name": "transfer", "args": {"amount": 1}}]},
        {"tool_calls": [{"name": "transfer", "args": {"amount": 2}}]},
        "done",
    ]
    driver, paused = _paused(make_driver, client, script)
    approvals = client.agent("bank").approvals
    run = approvals.resolve(paused.approval_id, approved=True)
    driver.drain("b-1")
    again = run.wait(timeout=5)
    assert again.finish_reason == "awaiting-approval" and again.approval_id != paused.approval_id
    run = approvals.resolve(again.approval_id, approved=True)  # type: ignore[arg-type]
    driver.drain("b-1")
    assert run.wait(timeout=5).text == "done"
    assert [name for name, _ in ran] == ["transfer", "transfer"]


def test_an_approved_call_interrupted_mid_run_gets_an_interrupted_result_not_a_second_run(
    make_driver: Callable[..., Driver], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = [{"tool_calls": [{"name": "transfer", "args": {"amount": 7}}]}, "checked"]
    driver, paused = _paused(make_driver, client, script)

    class Died(BaseException):
        pass

    def die_after_marker(point: str, session_id: str) -> None:
        if point == "after_started_marker_before_approved_call":
            raise Died

    import worker.batch

    monkeypatch.setattr(worker.batch, "crash_point", die_after_marker)
    client.agent("bank").approvals.resolve(paused.approval_id, approved=True)
    with pytest.raises(Died):
        driver.drain("b-1")
    checkpoint = client.store.load("b-1")
    assert checkpoint is not None and checkpoint.started_tool_call_ids == ["call_0_0"]
    assert checkpoint.status == "in-progress"
    monkeypatch.undo()
    driver.queue.clear()
    driver.drain("b-1")
    result = client.agent("bank").send([], session_id="b-1").wait(timeout=5)
    (interrupted,) = [m for m in result.messages if m.role == "tool"]
    assert json.loads(interrupted.content)["kind"] == "interrupted"
    assert ran == [] and result.text == "checked"


def test_ten_concurrent_resolves_decide_an_approval_once(
    make_driver: Callable[..., Driver], client: Client, settings: Settings, store: PostgresCheckpointStore
) -> None:
    _, paused = _paused(make_driver, client, [{"tool_calls": [{"name": "transfer", "args": {"amount": 3}}]}, "x"])
    outcomes: list[str] = []
    lock = threading.Lock()

    def decide(k: int) -> None:
        with Client(settings, engine=store.engine) as other:
            try:
                other.agent("bank").approvals.resolve(paused.approval_id, approved=k % 2 == 0)
                outcome = "decided"
            except errors.ApprovalNotFoundError:
                outcome = "already"
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=decide, args=(k,)) for k in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["already"] * 9 + ["decided"]


def test_resolving_after_the_run_was_deleted_is_orphaned_and_runs_nothing(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    _driver, paused = _paused(make_driver, client, [{"tool_calls": [{"name": "transfer", "args": {"amount": 4}}]}, "x"])
    assert client.agent("bank").delete("b-1")
    # A new run under the same id must not be touched by the stale approval.
    client.agent("bank").send("new request", session_id="b-1")
    with pytest.raises(errors.ApprovalOrphanedError):
        client.agent("bank").approvals.resolve(paused.approval_id, approved=True)
    with pytest.raises(errors.ApprovalOrphanedError):
        client.agent("bank").approvals.resolve(paused.approval_id, approved=True)
    assert ran == []
    assert client.agent("bank").approvals.list() == []


def test_unknown_approval_ids_are_not_found(make_driver: Callable[..., Driver], client: Client) -> None:
    make_driver(_bank(["x"]))
    for bad in ["nope", "", "x" * 500]:
        with pytest.raises(errors.ApprovalNotFoundError):
            client.agent("bank").approvals.resolve(bad, approved=True)
