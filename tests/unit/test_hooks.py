"""Tool-call hooks chained in order on the memory runtime: each sees the arguments the one before it left."""

from __future__ import annotations

from typing import Any

from tests.fakes.runtime import MemoryRuntime
from worker import Agent, Deny, Input, tool
from worker.hooks import HookContext, pre_tool_call
from worker.providers import MockModel

ran: list[dict[str, Any]] = []


@tool
def refund(order: str, amount: int, note: str = "") -> str:
    """Refund an order."""
    ran.append({"order": order, "amount": amount, "note": note})
    return f"refunded {amount}"


class Double:
    def pre_tool_call(self, ctx: HookContext) -> Input:
        return Input({**ctx.args, "amount": ctx.args["amount"] * 2})


class Cap:
    def pre_tool_call(self, ctx: HookContext) -> Input | None:
        if ctx.args["amount"] > 8:
            return Input({**ctx.args, "amount": 8, "note": f"capped from {ctx.args['amount']}"})
        return None


class Watch:
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def pre_tool_call(self, ctx: HookContext) -> None:
        self.seen.append(dict(ctx.args))


class Refuse:
    def pre_tool_call(self, ctx: HookContext) -> Deny:
        return Deny("no refunds today")


def _ctx(args: dict[str, Any]) -> HookContext:
    return HookContext(session_id="r", agent="desk", step=1, tool_call_id="c1", tool_name="refund", args=args)


def test_each_pre_tool_call_hook_sees_the_arguments_the_one_before_it_rewrote() -> None:
    watch = Watch()
    verdict = pre_tool_call([watch, Double(), watch, Cap(), watch], _ctx({"order": "o1", "amount": 5}))
    assert watch.seen == [
        {"order": "o1", "amount": 5},
        {"order": "o1", "amount": 10},
        {"order": "o1", "amount": 8, "note": "capped from 10"},
    ]
    assert isinstance(verdict, Input) and verdict.args == {"order": "o1", "amount": 8, "note": "capped from 10"}
    # A Deny after a rewrite ends the chain; hooks that return nothing leave the arguments alone.
    assert isinstance(pre_tool_call([Double(), Refuse(), Cap()], _ctx({"order": "o1", "amount": 5})), Deny)
    assert pre_tool_call([Watch(), Watch()], _ctx({"order": "o1", "amount": 5})) is None


def test_a_tool_runs_with_the_arguments_of_the_whole_chain() -> None:
    ran.clear()
    script = [
        {
            "tool_calls": [
                {"name": "refund", "args": {"order": "o2", "amount": 3}},
                {"name": "refund", "args": {"order": "o3", "amount": 6}},
            ]
        },
        "done",
    ]
    runtime = MemoryRuntime.build(
        [Agent(name="desk", model=MockModel(script), tools=[refund], hooks=[Double(), Cap()])]
    )
    runtime.send("r-1", "desk", "refund both")
    runtime.drain()
    assert ran == [{"order": "o2", "amount": 6, "note": ""}, {"order": "o3", "amount": 8, "note": "capped from 12"}]
    assert runtime.checkpoint("r-1").finish_reason == "stop"
