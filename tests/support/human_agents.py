"""Agents of the human-in-the-loop crash tests: a question asked mid-turn, and a tool that stops its run.

Workers import this module through ``LOUSHO_AGENTS=tests.support.human_agents``. The model is
``tests.support.agents.LoggedModel`` and every tool execution logs its start and end to ``LOUSHO_TEST_LOG``
with an execution id its result carries, as ``tests.support.agents.work`` does, so the checker can judge
these runs and a test can count how often each call ran.

A run's first user message is ``run <session_id>`` (``tests.support.agents.run_input``).

- ``asker`` asks ``ask_question`` and calls ``work`` in one turn, then answers with what the person said.
- ``shipper`` makes three calls in one turn, all at once: ``work``, ``ship``, ``work``. ``ship`` raises
  ``PropagatingToolError`` while the outage marker of its run (``outage_marker``) exists.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from store.records import Message
from tests.support.agents import LoggedModel, log_event, work
from tests.support.checker import LOG_ENV, response_tag
from worker import Agent, PropagatingToolError, ToolContext, tool

ASKER = "asker"
SHIPPER = "shipper"
QUESTION = "Which city should I book?"
OPTIONS = ["Oslo", "Rome"]
#: How long each ``work`` call of the shipper's turn takes, so ``ship`` raises while both still run.
WORK_MS = 600
#: How long ``ship`` works before it succeeds or raises.
SHIP_MS = 100
#: The asker's last turn: ``booked <answer>``, or ``not booked: <the person's note>`` when declined.
BOOKED = "booked "
NOT_BOOKED = "not booked: "


def outage_marker(log_path: Path, session_id: str) -> Path:
    """The file whose presence makes ``ship`` raise for ``session_id`` (beside the side-effect log)."""
    return log_path.with_name(f"outage-{session_id}")


def _run_id(messages: list[Message]) -> str:
    first = next(m for m in messages if m.role == "user")
    return str(first.content).split()[1]


def _nonce() -> str:
    return uuid.uuid4().hex[:12]


def _result_of(messages: list[Message], tool_name: str) -> dict[str, Any]:
    """The JSON body of the result of the (only) ``tool_name`` call in the transcript."""
    call_id = next(c.id for m in messages if m.role == "assistant" for c in m.tool_calls or () if c.name == tool_name)
    result = next(m for m in messages if m.role == "tool" and m.tool_call_id == call_id)
    body = json.loads(str(result.content))
    assert isinstance(body, dict)
    return body


def _ask(messages: list[Message]) -> dict[str, Any]:
    """Turn 0: a question and an ordinary call together; turn 1: the booking, from the question's result."""
    turn = sum(1 for m in messages if m.role == "assistant")
    nonce = _nonce()
    if turn == 0:
        return {
            "text": f"asking {response_tag(nonce)}",
            "tool_calls": [
                {"id": f"q-{nonce}", "name": "ask_question", "args": {"question": QUESTION, "options": OPTIONS}},
                {"id": f"w-{nonce}", "name": "work", "args": {"ms": 50}},
            ],
        }
    body = _result_of(messages, "ask_question")
    said = BOOKED + str(body["answer"]) if "answer" in body else NOT_BOOKED + str(body.get("note"))
    return {"text": f"{said} {response_tag(nonce)}"}


def _ship_order(messages: list[Message]) -> dict[str, Any]:
    """Turn 0: three calls in one turn; turn 1: final text."""
    turn = sum(1 for m in messages if m.role == "assistant")
    nonce = _nonce()
    if turn == 0:
        return {
            "text": f"shipping {response_tag(nonce)}",
            "tool_calls": [
                {"id": f"c0-{nonce}", "name": "work", "args": {"ms": WORK_MS}},
                {"id": f"c1-{nonce}", "name": "ship", "args": {"order": _run_id(messages)}},
                {"id": f"c2-{nonce}", "name": "work", "args": {"ms": WORK_MS}},
            ],
        }
    return {"text": f"shipped {response_tag(nonce)}"}


@tool
def ship(order: str, ctx: ToolContext) -> str:
    """Ship an order; while the carrier is down (the outage marker exists) the run must stop, not go on."""
    execution = _nonce()
    record = {
        "kind": "tool",
        "run_id": ctx.session_id,
        "tool_call_id": ctx.tool_call_id,
        "base_seq": ctx.checkpoint_seq,
        "exec": execution,
        "approved": False,
    }
    log_event({**record, "phase": "start", "ms": SHIP_MS})
    time.sleep(SHIP_MS / 1000)
    if outage_marker(Path(os.environ[LOG_ENV]), ctx.session_id).exists():
        log_event({**record, "phase": "raised"})
        raise PropagatingToolError("the carrier is down; resume the run once it is back")
    log_event({**record, "phase": "end"})
    return json.dumps({"exec": execution, "pid": os.getpid(), "shipped": order})


asker = Agent(
    name=ASKER,
    model=LoggedModel(_ask, model_id="human-mock"),
    instructions="Question-test agent.",
    tools=[work],
    ask_question=True,
    max_steps=10,
    tool_concurrency=2,
)
#: Three calls at once, so the two ``work`` calls are still running when ``ship`` raises.
shipper = Agent(
    name=SHIPPER,
    model=LoggedModel(_ship_order, model_id="human-mock"),
    instructions="Propagating-error test agent.",
    tools=[work, ship],
    max_steps=10,
    tool_concurrency=3,
)
