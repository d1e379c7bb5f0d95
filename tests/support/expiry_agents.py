"""The agent the expiry crash tests run: one turn opens an approval and a question that expire, a scripted model.

Workers import this module through ``LOUSHO_AGENTS=tests.support.expiry_agents``. Every model call and every
execution of the gated tool are appended to ``LOUSHO_TEST_LOG`` (as ``tests.support.agents`` does), so a test
can tell whether the gated call ran and which results the model was shown.

A run's first user message, written by ``ask``, reads ``expiring <session_id>``: the first model turn asks
for one ``refund`` call (it needs a human approval) and one ``ask_question``; the next turn ends the run.
"""

from __future__ import annotations

import json
from typing import Any

from store.records import Message
from tests.support.agents import log_event
from worker import Agent, ToolContext, tool
from worker.providers import MockModel

AGENT = "expiring"
#: Seconds the refund's approval and the question wait for a decision before they count as rejected.
EXPIRES_IN_S = 2
#: What the last turn answers.
DONE = "handled without a decision"


def ask(session_id: str) -> str:
    """The first user message of a run."""
    return f"{AGENT} {session_id}"


def _shown(result: Message) -> Any:
    """A tool result as the model saw it: JSON (a structured result or error) or plain text."""
    try:
        return json.loads(str(result.content))
    except ValueError:
        return result.content


def _script(messages: list[Message]) -> dict[str, Any]:
    """A refund and a question on the first turn; then log the results shown and end."""
    first = str(next(m.content for m in messages if m.role == "user"))
    session_id = first.removeprefix(f"{AGENT} ")
    turn = sum(1 for m in messages if m.role == "assistant")
    results = {str(m.name): _shown(m) for m in messages if m.role == "tool"}
    log_event({"kind": "model", "run_id": session_id, "turn_index": turn, "results": results})
    if turn == 0:
        return {
            "tool_calls": [
                {"name": "refund", "args": {"amount": 7}},
                {
                    "name": "ask_question",
                    "args": {"question": "Refund to which account?", "options": ["card", "wallet"]},
                },
            ]
        }
    return {"text": DONE}


@tool(needs_approval=True, expires_in=EXPIRES_IN_S)
def refund(amount: int, ctx: ToolContext) -> str:
    """Refund money once a person approved it."""
    log_event({"kind": "tool", "run_id": ctx.session_id, "tool_call_id": ctx.tool_call_id, "phase": "start"})
    return f"refunded {amount}"


expiring = Agent(
    name=AGENT,
    model=MockModel(_script, model_id="expiry-mock"),
    instructions="Expiry-test agent.",
    tools=[refund],
    ask_question=True,
    approval_expires_in=EXPIRES_IN_S,
    max_steps=5,
)
