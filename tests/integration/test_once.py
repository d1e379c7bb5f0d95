"""``once`` calls on Postgres: the started mark is a fenced save of its own, and reconciliations are stored as such.

The step dies in process (``tests.fakes.crash``); its lease is dropped from Redis as if it had expired.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import redis

from producer.client import Client
from store import keys
from store.checkpoints import PostgresCheckpointStore
from store.leases import LeaseManager
from tests.fakes.crash import Crashes, SimulatedCrash
from tests.support.driver import Driver
from worker import Agent, ToolContext, tool
from worker.steps import Outcome

SID = "once-1"
charges: dict[str, str] = {}
executed: list[int] = []


def charge_happened(args: dict[str, Any], ctx: ToolContext) -> str | None:
    found = charges.get(args["order"])
    return None if found is None else f"charged as {found}"


def _charge(order: str, ctx: ToolContext) -> str:
    """Charge the card for an order."""
    executed.append(ctx.attempt)
    charges[order] = f"ch_{order}"
    return f"charged as ch_{order}"


def _agent(reconcile: bool) -> Agent:
    from worker.providers import MockModel

    once_tool = tool(once=True, reconcile=charge_happened if reconcile else None)(_charge)
    return Agent(
        name="till",
        model=MockModel([{"tool_calls": [{"name": "_charge", "args": {"order": "7"}}]}, "Charged."]),
        tools=[once_tool],
    )


def _crash_after_effect(driver: Driver, leases: LeaseManager, redis_client: redis.Redis, client: Client) -> None:
    charges.clear()
    executed.clear()
    client.agent("till").send("Charge order 7", session_id=SID, check_agent=False)
    crashes = Crashes()
    with crashes.installed(leases):
        crashes.arm("after_once_effect_before_result_save", SID)
        with pytest.raises(SimulatedCrash):
            driver.drain(SID)
        crashes.recovered()
    driver.queue.clear()
    redis_client.delete(keys.lease_key(SID))  # the dead worker's lease expired


def test_a_reconciled_once_call_is_marked_then_settled_by_fenced_saves_with_its_event(
    make_driver: Callable[..., Driver],
    client: Client,
    store: PostgresCheckpointStore,
    leases: LeaseManager,
    redis_client: redis.Redis,
) -> None:
    driver = make_driver(_agent(reconcile=True))
    _crash_after_effect(driver, leases, redis_client, client)
    marked = store.load(SID)
    assert marked is not None and marked.started_tool_call_ids == ["call_0_0"]
    assert driver.drain(SID)[-1] == Outcome.FINISHED
    assert executed == [1]
    final = store.load(SID)
    assert final is not None and final.started_tool_call_ids == []
    assert [m.content for m in final.messages if m.role == "tool"] == ["charged as ch_7"]
    # Saved: the model turn, the mark (before the effect), the reconciled result, the final answer
    marks = [e.checkpoint.started_tool_call_ids for e in reversed(store.history(SID))]
    assert marks == [[], ["call_0_0"], [], []]
    events = [e for e in client.read_events(SID, -1) if e.type == "tool.reconcile"]
    assert [(e.data["outcome"], e.data["by"], e.data["attempt"]) for e in events] == [("happened", "reconcile", 2)]
    assert [r.reconciliations for r in driver.reports if r.reconciliations] == [[("_charge", "happened")]]


def test_a_reconcile_approval_is_listed_and_answered_from_another_process(
    make_driver: Callable[..., Driver],
    client: Client,
    store: PostgresCheckpointStore,
    leases: LeaseManager,
    redis_client: redis.Redis,
) -> None:
    driver = make_driver(_agent(reconcile=False))
    _crash_after_effect(driver, leases, redis_client, client)
    assert driver.drain(SID) == [Outcome.PAUSED]
    [asked] = client.approvals.list()
    assert (asked.kind, asked.tool_name, asked.args, asked.expires_at) == ("reconcile", "_charge", {"order": "7"}, None)
    assert asked.question is not None and "Did it take effect?" in asked.question
    assert [(p.state, p.approval_kind) for p in client.agent("till").pending()] == [("awaiting-approval", "reconcile")]
    requested = [e for e in client.read_events(SID, -1) if e.type == "approval.requested"]
    assert requested[-1].data["kind"] == "reconcile" and requested[-1].data["question"] == asked.question

    run = client.approvals.resolve(asked.approval_id, answer="charged as ch_7 (dashboard)")
    assert driver.drain(SID)[-1] == Outcome.FINISHED
    assert run.wait(timeout=5).finish_reason == "stop"
    final = store.load(SID)
    assert final is not None
    assert [m.content for m in final.messages if m.role == "tool"] == ["charged as ch_7 (dashboard)"]
    assert executed == [1]
    decided = client.approvals._store.by_ids([asked.approval_id])[asked.approval_id]
    assert (decided.status, decided.answer) == ("approved", "charged as ch_7 (dashboard)")


def test_a_reconcile_approval_approved_runs_the_call_again_and_rejected_records_not_done(
    make_driver: Callable[..., Driver],
    client: Client,
    store: PostgresCheckpointStore,
    leases: LeaseManager,
    redis_client: redis.Redis,
) -> None:
    driver = make_driver(_agent(reconcile=False))
    _crash_after_effect(driver, leases, redis_client, client)
    driver.drain(SID)
    [asked] = client.approvals.list()
    client.approvals.resolve(asked.approval_id, approved=True)
    assert driver.drain(SID)[-1] == Outcome.FINISHED
    assert executed == [1, 2]

    client.agent("till").delete(SID)
    _crash_after_effect(driver, leases, redis_client, client)
    driver.drain(SID)
    [asked] = client.approvals.list()
    client.approvals.resolve(asked.approval_id, approved=False, note="refunded")
    assert driver.drain(SID)[-1] == Outcome.FINISHED
    final = store.load(SID)
    assert final is not None
    (result,) = [json.loads(m.content) for m in final.messages if m.role == "tool"]
    assert (result["kind"], result["note"]) == ("not-done", "refunded") and executed == [1]
