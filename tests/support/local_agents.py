"""An agent with every part ``run_local`` must run as a worker does: tools, a gated call, a sub-agent and a hook.

``desk``'s first turn calls ``lookup`` (whose city a ``pre_tool_call`` hook title-cases), ``charge`` (needs an
approval) and ``task`` (a ``clerk`` child run files the receipt); its second turn answers from the results. The
model is scripted and the tools pure, so the run on real workers (``LOUSHO_AGENTS=tests.support.local_agents``) and
in ``worker.testing.run_local`` must give the same transcript, ids aside. ``tests.support.local_agents_v2`` has
the same agent with another second answer (a replay against it diverges at its second turn).
"""

from __future__ import annotations

from worker import Agent, tool
from worker.hooks import HookContext, Input
from worker.providers import MockModel

FIRST = {
    "text": "Let me see.",
    "tool_calls": [
        {"name": "lookup", "args": {"city": "oslo"}},
        {"name": "charge", "args": {"amount": 5}},
        {"name": "task", "args": {"agent": "clerk", "prompt": "File the receipt for 5.", "description": "file"}},
    ],
    "usage": {"input_tokens": 40, "output_tokens": 12},
}
ANSWER = {"text": "Sunny in Oslo; charged 5 and filed.", "usage": {"input_tokens": 90, "output_tokens": 9}}


@tool
def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@tool(needs_approval=True)
def charge(amount: int) -> str:
    """Charge the customer."""
    return f"charged {amount}"


class TitleCity:
    """Title-cases the city of every ``lookup`` call."""

    def pre_tool_call(self, ctx: HookContext) -> Input | None:
        """Rewrite ``lookup``'s city."""
        if ctx.tool_name == "lookup":
            return Input({**ctx.args, "city": str(ctx.args["city"]).title()})
        return None


clerk = Agent(name="clerk", model=MockModel(["Filed."]), instructions="You file receipts.")
desk = Agent(
    name="desk",
    model=MockModel([FIRST, ANSWER]),
    instructions="You run the front desk.",
    tools=[lookup, charge],
    subagents=[clerk],
    hooks=[TitleCity()],
)
