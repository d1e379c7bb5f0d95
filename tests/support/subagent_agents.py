"""Agents of the sub-agent crash tests: leads whose ``task`` calls start child runs of ``researcher``.

Workers import this module through ``LOUSHO_AGENTS=tests.support.subagent_agents``. Every model is
``tests.support.agents.LoggedModel`` and the tools are the logged ``work`` and ``approved_work``, so the checker
can judge leads and children alike. A lead's first user message is ``run <session_id>``; the prompt of each child is
``run <child run id> key=value ...`` (the shape ``tests.support.agents.parse_shape`` reads), the lead naming the id
its ``task`` call's child run will have (``worker.subagents.child_id``), so the child's model calls are logged under
its own run.

- ``researcher`` (the child): a ``work`` call per slot of each tool turn (``approved_work`` where the prompt says
  ``gate=T.K``), then ``<run id> found <n> notes``. Its call ids are made from the run its prompt names, the turn and
  the slot, so a child started again with the same prompt asks for the very same calls.
- ``lead``: two children at once (``PAIR``), each ``work`` call of 0.9-1.3 s, run one after the other.
- ``editor``: one child whose first turn is a ``work`` call and an ``approved_work`` call (``GATED``).
- ``fan_lead``: eight children of five 200 ms tool steps each (``FAN``).
- ``slow_lead``: a ``work`` call of ``SLOW_WORK_MS`` and one child's ``task`` call in its first turn (a lead deleted
  while the call runs must start no child).

Each lead's second turn ends its run with ``<lead> read: <each result's first line, untagged>``. Usage is scripted
per turn (``LEAD_USAGE``, ``CHILD_USAGE``) so a test can add it up.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

from store.records import Message
from tests.support.agents import LoggedModel, approved_work, parse_shape, run_input, work
from tests.support.checker import APPROVED_TOOL, response_tag
from worker import Agent, subagents

CHILD = "researcher"
LEAD = "lead"
EDITOR = "editor"
FAN_LEAD = "fan_lead"
SLOW_LEAD = "slow_lead"
#: The ``work`` call before ``slow_lead``'s ``task`` call: the window in which a test deletes the lead.
SLOW_WORK_MS = 3000
#: What each model turn of a lead, and of a child, reports it used.
LEAD_USAGE = {"input_tokens": 1000, "output_tokens": 100}
CHILD_USAGE = {"input_tokens": 10, "output_tokens": 1}
#: The children of ``lead``: two tool turns of two ``work`` calls each, run one after the other.
PAIR = {"turns": 3, "calls": 2, "sleep": "900-1300"}
#: The child of ``editor``: a ``work`` call and an ``approved_work`` call in its first turn.
GATED = {"turns": 2, "calls": 2, "sleep": 300, "gate": "0.1"}
#: One child of ``fan_lead``, and one of the independent runs it is compared with: five 200 ms tool steps.
FAN = {"turns": 6, "calls": 1, "sleep": 200, "model": 20}
FAN_CHILDREN = 8


def _turn(messages: list[Message]) -> int:
    return sum(1 for m in messages if m.role == "assistant")


def _research(messages: list[Message]) -> dict[str, Any]:
    """A child's turn: its prompt's tool turns, then its findings."""
    shape = parse_shape(str(next(m.content for m in messages if m.role == "user")))
    turn, nonce = _turn(messages), uuid.uuid4().hex[:12]
    if turn >= shape.turns - 1:
        notes = sum(1 for m in messages if m.role == "tool")
        return {"text": f"{shape.run_id} found {notes} notes {response_tag(nonce)}", "usage": CHILD_USAGE}
    tag = shape.run_id[-8:]
    calls = [
        {
            "id": f"c{turn}-{k}-{tag}",
            "name": APPROVED_TOOL if (turn, k) in shape.gated else "work",
            "args": {"ms": shape.sleep_of(turn, k)},
        }
        for k in range(shape.calls_in(turn))
    ]
    return {"text": f"turn {turn} {response_tag(nonce)}", "tool_calls": calls, "usage": CHILD_USAGE}


def delegating(children: int, shape: Mapping[str, object]) -> Callable[[list[Message]], dict[str, Any]]:
    """A lead's script: ``children`` ``task`` calls of ``shape`` in its first turn, then what they found."""

    def lead(messages: list[Message]) -> dict[str, Any]:
        lead_id = parse_shape(str(next(m.content for m in messages if m.role == "user"))).run_id
        turn, nonce = _turn(messages), uuid.uuid4().hex[:12]
        if turn > 0:
            # Without the children's response tags: the checker reads the first tag of a turn as its own.
            found = " | ".join(str(m.content).splitlines()[0].split(" [resp:")[0] for m in messages if m.role == "tool")
            return {"text": f"{lead_id} read: {found} {response_tag(nonce)}", "usage": LEAD_USAGE}
        calls = []
        for k in range(children):
            call_id = f"t{k}-{nonce}"
            # The step of this turn's batch is the turn count after it: the child's id is known now.
            child = subagents.child_id(lead_id, turn + 1, call_id)
            assert child is not None, "the lead's id is too long for a child's"
            calls.append(
                {
                    "id": call_id,
                    "name": "task",
                    "args": {"agent": CHILD, "prompt": run_input(child, **shape), "description": f"part {k}"},
                }
            )
        return {"text": f"delegating {response_tag(nonce)}", "tool_calls": calls, "usage": LEAD_USAGE}

    return lead


def _slow_then_delegate(messages: list[Message]) -> dict[str, Any]:
    """``slow_lead``'s script: a long ``work`` call and a ``task`` call, then an answer."""
    lead_id = parse_shape(str(next(m.content for m in messages if m.role == "user"))).run_id
    turn, nonce = _turn(messages), uuid.uuid4().hex[:12]
    if turn > 0:
        return {"text": f"{lead_id} done {response_tag(nonce)}", "usage": LEAD_USAGE}
    call_id = f"t0-{nonce}"
    child = subagents.child_id(lead_id, turn + 1, call_id)
    assert child is not None, "the lead's id is too long for a child's"
    return {
        "text": f"working {response_tag(nonce)}",
        "usage": LEAD_USAGE,
        "tool_calls": [
            {"id": f"w0-{nonce}", "name": "work", "args": {"ms": SLOW_WORK_MS}},
            {
                "id": call_id,
                "name": "task",
                "args": {"agent": CHILD, "prompt": run_input(child, turns=2, calls=1, sleep=50)},
            },
        ],
    }


researcher = Agent(
    name=CHILD,
    model=LoggedModel(_research, model_id="child-mock"),
    instructions="Sub-agent crash-test agent.",
    tools=[work, approved_work],
    max_steps=20,
    tool_concurrency=1,
)
lead = Agent(
    name=LEAD,
    model=LoggedModel(delegating(2, PAIR), model_id="lead-mock"),
    instructions="Lead crash-test agent.",
    subagents=[researcher],
    tool_concurrency=2,
)
editor = Agent(
    name=EDITOR,
    model=LoggedModel(delegating(1, GATED), model_id="lead-mock"),
    instructions="Lead crash-test agent.",
    subagents=[researcher],
)
fan_lead = Agent(
    name=FAN_LEAD,
    model=LoggedModel(delegating(FAN_CHILDREN, FAN), model_id="lead-mock"),
    instructions="Lead crash-test agent.",
    subagents=[researcher],
    tool_concurrency=FAN_CHILDREN,
)
slow_lead = Agent(
    name=SLOW_LEAD,
    model=LoggedModel(_slow_then_delegate, model_id="lead-mock"),
    instructions="Lead crash-test agent.",
    tools=[work],
    subagents=[researcher],
    tool_concurrency=1,
)
