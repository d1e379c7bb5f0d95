"""Agents of the business-state crash test: a ledger whose tool writes the run's business state.

Workers import this module through ``LOUSHO_AGENTS=tests.support.state_agents``. A run's first user message is
``run <session_id>``. ``ledger`` answers turns 0 and 1 with one ``record`` call each (``entry`` ``a``, then ``b``)
and turn 2 with ``ledger done``. ``record`` logs each execution (``kind`` ``ledger``) and appends its entry to
``ctx.business_state["entries"]``.
"""

from __future__ import annotations

import uuid
from typing import Any

from store.records import Message
from tests.support.agents import log_event
from worker import Agent, ToolContext, tool
from worker.providers import MockModel

LEDGER = "ledger"
ENTRIES = ("a", "b")


@tool
def record(entry: str, ctx: ToolContext) -> str:
    """Record an entry in the ledger."""
    log_event({"kind": "ledger", "run_id": ctx.session_id, "tool_call_id": ctx.tool_call_id, "entry": entry})
    before = ctx.business_state or {}
    ctx.business_state = {**before, "entries": [*before.get("entries", []), entry]}
    return f"recorded {entry}"


def _ledger(messages: list[Message]) -> dict[str, Any] | str:
    turn = sum(1 for m in messages if m.role == "assistant")
    if turn < len(ENTRIES):
        return {
            "tool_calls": [
                {"id": f"r{turn}-{uuid.uuid4().hex[:8]}", "name": "record", "args": {"entry": ENTRIES[turn]}}
            ]
        }
    return "ledger done"


ledger = Agent(
    name=LEDGER, model=MockModel(_ledger, model_id="ledger-model"), tools=[record], instructions="Keep the ledger."
)
