"""Handoffs: a ``transfer_to_<name>`` call moves the run to another agent (its model, tools and instructions) for every
later step and follow-up; only a turn's first handoff is made; the run's hooks and step budget stay; ``max_handoffs``
caps them. Real services, steps in-process."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from producer.client import Client
from store.records import Message
from tests.support.driver import Driver
from worker import Agent, HookContext, tool
from worker.providers import MockModel


@tool
def refund(order: str) -> str:
    """Refund an order."""
    return f"refunded {order}"


def _agents(max_handoffs: int = 5) -> tuple[Agent, Agent]:
    # MockModel answers by the number of assistant turns in the transcript: the first is the front desk's.
    billing = Agent(
        name="billing",
        model=MockModel(
            [
                "(never asked)",
                {"tool_calls": [{"name": "refund", "args": {"order": "o1"}}]},
                "billing: refunded o1",
                "billing again",
            ],
            model_id="billing-model",
        ),
        instructions="You are the billing desk.",
        tools=[refund],
    )
    front = Agent(
        name="front",
        model=MockModel(
            [
                {
                    "tool_calls": [
                        {"name": "transfer_to_billing", "args": {"reason": "a refund"}},
                        {"name": "transfer_to_billing", "args": {"reason": "twice"}},
                    ]
                }
            ],
            model_id="front-model",
        ),
        instructions="You are the front desk.",
        handoffs=[billing],
        max_handoffs=max_handoffs,
    )
    return front, billing


def test_a_handoff_moves_the_run_to_the_target_for_every_later_step_and_follow_up(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    front, billing = _agents()
    driver = make_driver(front, billing)
    run = client.agent("front").send("I want my money back", session_id="ho-1")
    driver.drain("ho-1")
    result = run.wait(timeout=5)
    assert result.text == "billing: refunded o1" and result.steps == 3  # the step budget runs across agents
    checkpoint = client.agent("front").load("ho-1")
    assert checkpoint is not None and checkpoint.agent == "front" and checkpoint.active_agent == "billing"
    first, second, refunded = [m for m in checkpoint.messages if m.role == "tool"]
    assert json.loads(str(first.content)) == {"transferred_to": "billing", "from": "front"}
    assert second.is_error and json.loads(str(second.content))["kind"] == "not-run"  # only the first is made
    assert refunded.content == "refunded o1"  # billing's own tool
    assert checkpoint.messages[0].content == "You are the front desk."  # the saved transcript is untouched
    types = [e.type for e in client.read_events("ho-1", -1)]
    assert "agent.handoff" in types and "agent.drift" not in types  # drift is checked against the agent handed to
    # A follow-up continues with the agent the run was handed to.
    again = client.agent("front").send("And the other order?", session_id="ho-1")
    driver.drain("ho-1")
    assert again.wait(timeout=5).text == "billing again"


def test_the_target_sees_its_own_instructions_and_the_runs_hooks_stay(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    systems: list[str] = []
    seen: list[tuple[str, str | None]] = []

    def billing_answer(messages: list[Message]) -> Any:
        systems.append(str(messages[0].content))
        return "billing speaking"

    class Audit:
        def pre_tool_call(self, ctx: HookContext) -> None:
            seen.append((ctx.agent, ctx.tool_name))

    billing = Agent(name="billing2", model=MockModel(billing_answer), instructions="Billing rules.")
    front = Agent(
        name="front2",
        model=MockModel([{"tool_calls": [{"name": "transfer_to_billing2", "args": {}}]}]),
        instructions="Front rules.",
        handoffs=[billing],
        hooks=[Audit()],
    )
    driver = make_driver(front, billing)
    client.agent("front2").send("hi", session_id="ho-2")
    driver.drain("ho-2")
    assert systems == ["Billing rules."]
    assert seen == [("front2", "transfer_to_billing2")]


def test_max_handoffs_refuses_one_more(make_driver: Callable[..., Driver], client: Client) -> None:
    front, billing = _agents(max_handoffs=0)
    driver = make_driver(front, billing)
    client.agent("front").send("refund", session_id="ho-3")
    driver.drain("ho-3")
    checkpoint = client.agent("front").load("ho-3")
    assert checkpoint is not None and checkpoint.active_agent is None
    first = next(m for m in checkpoint.messages if m.role == "tool")
    assert json.loads(str(first.content))["error"] == "TooManyHandoffs"


ran_refunds: list[str] = []


@tool(needs_approval=True)
def gated_refund(order: str) -> str:
    """Refund an order once a person agreed."""
    ran_refunds.append(order)
    return f"refunded {order}"


def _gated_desk(first: list[dict[str, Any]]) -> tuple[Agent, Agent]:
    """A desk whose first turn asks for ``first``: a gated refund and a handoff to a desk without that tool."""
    after = Agent(
        name="aftercare", model=MockModel(["(never asked)", "aftercare: all settled"]), instructions="You follow up."
    )
    desk = Agent(
        name="desk",
        model=MockModel([{"tool_calls": first}, "(desk never asked again)"]),
        tools=[gated_refund],
        handoffs=[after],
    )
    return desk, after


REFUND_THEN_HANDOFF = [
    {"name": "gated_refund", "args": {"order": "o7"}},
    {"name": "transfer_to_aftercare", "args": {"reason": "follow up"}},
]


def test_a_handoff_in_a_turn_with_a_gated_call_waits_for_the_decision_and_the_call_runs_as_its_asker(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    ran_refunds.clear()
    desk, after = _gated_desk(REFUND_THEN_HANDOFF)
    driver = make_driver(desk, after)
    paused = client.agent("desk").send("refund o7 and hand me over", session_id="ho-gated")
    driver.drain("ho-gated")
    assert paused.wait(timeout=5).finish_reason == "awaiting-approval"
    held = client.agent("desk").load("ho-gated")
    assert held is not None and held.active_agent is None  # not handed off while a decision is owed
    assert [c.name for c in held.pending_tool_calls] == ["gated_refund", "transfer_to_aftercare"]

    (approval,) = client.agent("desk").approvals.list()
    resumed = client.agent("desk").approvals.resolve(approval.approval_id, approved=True)
    driver.drain("ho-gated")
    result = resumed.wait(timeout=5)
    assert result.finish_reason == "stop" and result.text == "aftercare: all settled"
    assert ran_refunds == ["o7"]  # the approved call ran once, as the desk that asked for it
    done = client.agent("desk").load("ho-gated")
    assert done is not None and done.active_agent == "aftercare" and done.last_error is None
    refunded, handed = [m for m in done.messages if m.role == "tool"]
    assert refunded.content == "refunded o7" and not refunded.is_error
    assert json.loads(str(handed.content)) == {"transferred_to": "aftercare", "from": "desk"}


def test_a_handoff_before_a_rejected_gated_call_is_made_after_the_rejection(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    ran_refunds.clear()
    desk, after = _gated_desk(list(reversed(REFUND_THEN_HANDOFF)))
    driver = make_driver(desk, after)
    client.agent("desk").send("hand me over, then refund o7", session_id="ho-gated-2")
    driver.drain("ho-gated-2")
    (approval,) = client.agent("desk").approvals.list()
    resumed = client.agent("desk").approvals.resolve(approval.approval_id, approved=False, note="no refunds today")
    driver.drain("ho-gated-2")
    assert resumed.wait(timeout=5).text == "aftercare: all settled"
    assert ran_refunds == []
    done = client.agent("desk").load("ho-gated-2")
    assert done is not None and done.active_agent == "aftercare"
    handed, rejected = [m for m in done.messages if m.role == "tool"]
    assert json.loads(str(handed.content))["transferred_to"] == "aftercare"
    assert rejected.is_error and "no refunds today" in str(rejected.content)
