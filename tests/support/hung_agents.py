"""The agent of the hung-call crash test: a timed tool whose calls never answer in time and ignore ``ctx.cancelled``.

Workers import this module through ``LOUSHO_AGENTS=tests.support.hung_agents``. Every start of a ``stall`` call is
appended to ``LOUSHO_TEST_LOG`` with the pid of the process that runs it (``tests.support.agents.log_event``), and
so is every model call.

``stalling``'s first turn asks for ``CALLS`` ``stall`` calls; its second says ``gave up``; a follow-up is answered
``still here``.
"""

from __future__ import annotations

import threading
from typing import Any

from store.records import Message
from tests.support.agents import log_event
from worker import Agent, ToolContext, tool
from worker.providers import MockModel

AGENT = "stalling"
#: Calls of the first turn: each hangs past its timeout.
CALLS = 3
#: How long a stalled call holds its thread (seconds): far past its timeout, short enough to end with the test.
STALL_S = 20.0


@tool(timeout=0.2)
def stall(key: str, ctx: ToolContext) -> str:
    """Call a service that does not answer (and does not listen to ``ctx.cancelled``)."""
    log_event({"kind": "stall", "run_id": ctx.session_id, "tool_call_id": ctx.tool_call_id})
    threading.Event().wait(STALL_S)
    return f"{key} answered too late"


def _script(messages: list[Message]) -> dict[str, Any] | str:
    turn = sum(1 for m in messages if m.role == "assistant")
    log_event({"kind": "model", "turn_index": turn})
    if turn == 0:
        return {"tool_calls": [{"name": "stall", "args": {"key": f"k{n}"}} for n in range(CALLS)]}
    return "gave up" if turn == 1 else "still here"


stalling = Agent(name=AGENT, model=MockModel(_script), tools=[stall], tool_concurrency=CALLS)
