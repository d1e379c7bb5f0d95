"""The agent the abort and steer crash tests run: slow tools that stop on ``ctx.cancelled``, a scripted model.

Workers import this module through ``LOUSHO_AGENTS=tests.support.abort_agents``. Every model call and the
start and end of every tool execution are appended to ``LOUSHO_TEST_LOG`` (one ``os.write`` per line, as
``tests.support.agents`` does), so a test can tell which calls ran and what the model was shown.

A run's first user message, written by ``ask``, reads ``abortable <session_id> calls=N ms=MS [gate]``: the
first model turn asks for N ``slow`` calls of MS ms each (or, with ``gate``, one ``gated`` call that needs a
human approval); every later turn answers ``heard: <the last user message>`` and ends the run.
"""

from __future__ import annotations

from typing import Any

from store.records import Message
from tests.support.agents import log_event
from worker import Agent, Tool, ToolContext, tool
from worker.providers import MockModel

AGENT = "abortable"
#: What every model turn after the first answers, followed by the last user message it was shown.
HEARD = "heard: "


def ask(session_id: str, calls: int = 3, ms: int = 2000, gate: bool = False) -> str:
    """The first user message of a run: one turn of ``calls`` slow calls of ``ms`` ms, or one gated call."""
    return f"{AGENT} {session_id} calls={calls} ms={ms}" + (" gate" if gate else "")


def _shape(text: str) -> tuple[str, int, int, bool]:
    """(session id, calls, ms, gate) from a message written by ``ask``."""
    words = text.split()
    if len(words) < 2 or words[0] != AGENT:
        raise ValueError(f"the first user message must come from ask(), got {text[:80]!r}")
    options = dict(word.partition("=")[::2] for word in words[2:])
    return words[1], int(options.get("calls", 3)), int(options.get("ms", 2000)), "gate" in options


def _script(messages: list[Message]) -> dict[str, Any]:
    """Tool calls on the first turn, then ``heard: <last user message>``; each call is logged."""
    users = [str(m.content) for m in messages if m.role == "user"]
    session_id, calls, ms, gate = _shape(users[0])
    turn = sum(1 for m in messages if m.role == "assistant")
    log_event({"kind": "model", "run_id": session_id, "turn_index": turn, "last_user": users[-1]})
    if turn > 0:
        return {"text": HEARD + users[-1]}
    if gate:
        return {"tool_calls": [{"name": "gated", "args": {}}]}
    return {"tool_calls": [{"name": "slow", "args": {"ms": ms}} for _ in range(calls)]}


@tool
def slow(ms: int, ctx: ToolContext) -> str:
    """Work ``ms`` milliseconds, stopping at once when the run is aborted."""
    record = {"kind": "tool", "run_id": ctx.session_id, "tool_call_id": ctx.tool_call_id}
    log_event({**record, "phase": "start", "ms": ms})
    stopped = ctx.cancelled.wait(ms / 1000)
    log_event({**record, "phase": "end", "cancelled": stopped})
    return "stopped early" if stopped else f"worked {ms} ms"


def _gated(ctx: ToolContext) -> str:
    """Do something a human must approve first."""
    record = {"kind": "tool", "run_id": ctx.session_id, "tool_call_id": ctx.tool_call_id}
    log_event({**record, "phase": "start", "ms": 0})
    log_event({**record, "phase": "end", "cancelled": False})
    return "done"


gated = Tool(_gated, name="gated", needs_approval=True)

#: One call at a time, so an abort or a steer mid-batch finds one call running and the others not started.
abortable = Agent(
    name=AGENT,
    model=MockModel(_script, model_id="abort-mock"),
    instructions="Abort-test agent.",
    tools=[slow, gated],
    max_steps=10,
    tool_concurrency=1,
)
