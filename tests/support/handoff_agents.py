"""Agents of the handoff crash test: a front desk that hands every run to the refund desk.

Workers import this module through ``LOUSHO_AGENTS=tests.support.handoff_agents``. Both models are
``tests.support.agents.LoggedModel`` and the refund desk's tool is ``tests.support.agents.work`` (logged, with the
execution id in its result), so the checker can judge these runs. A run's first user message is ``run <session_id>``.

- ``front`` answers turn 0 with ``transfer_to_refunds``; asked anything later it says ``front answered``.
- ``refunds`` answers turn 1 with a slow ``work`` call (``WORK_MS``) and turn 2 with ``refunds answered``.
- ``gated_front`` answers turn 0 with a slow approval-gated call (``approved_work``) and ``transfer_to_refunds`` in the
  same turn; asked anything later it says ``gated front answered``.
"""

from __future__ import annotations

import uuid
from typing import Any

from store.records import Message
from tests.support.agents import LoggedModel, approved_work, work
from tests.support.checker import APPROVED_TOOL, response_tag
from worker import Agent

FRONT = "front"
REFUNDS = "refunds"
GATED_FRONT = "gated_front"
#: How long the refund desk's call works: long enough to kill its worker in the middle of it.
WORK_MS = 2500


def _turn(messages: list[Message]) -> int:
    return sum(1 for m in messages if m.role == "assistant")


def _front(messages: list[Message]) -> dict[str, Any]:
    nonce = uuid.uuid4().hex[:12]
    if _turn(messages) == 0:
        return {
            "text": f"handing over {response_tag(nonce)}",
            "tool_calls": [{"id": f"h-{nonce}", "name": f"transfer_to_{REFUNDS}", "args": {"reason": "a refund"}}],
        }
    return {"text": f"front answered {response_tag(nonce)}"}


def _refunds(messages: list[Message]) -> dict[str, Any]:
    nonce = uuid.uuid4().hex[:12]
    if _turn(messages) == 1:
        return {
            "text": f"refunding {response_tag(nonce)}",
            "tool_calls": [{"id": f"w-{nonce}", "name": "work", "args": {"ms": WORK_MS}}],
        }
    return {"text": f"refunds answered {response_tag(nonce)}"}


refunds = Agent(
    name=REFUNDS,
    model=LoggedModel(_refunds, model_id="refunds-model"),
    tools=[work],
    instructions="You are the refund desk.",
)
front = Agent(
    name=FRONT,
    model=LoggedModel(_front, model_id="front-model"),
    instructions="You are the front desk.",
    handoffs=[refunds],
)


def _gated_front(messages: list[Message]) -> dict[str, Any]:
    nonce = uuid.uuid4().hex[:12]
    if _turn(messages) == 0:
        return {
            "text": f"refunding, then handing over {response_tag(nonce)}",
            "tool_calls": [
                {"id": f"g-{nonce}", "name": APPROVED_TOOL, "args": {"ms": WORK_MS}},
                {"id": f"h-{nonce}", "name": f"transfer_to_{REFUNDS}", "args": {"reason": "after the refund"}},
            ],
        }
    return {"text": f"gated front answered {response_tag(nonce)}"}


gated_front = Agent(
    name=GATED_FRONT,
    model=LoggedModel(_gated_front, model_id="gated-front-model"),
    tools=[approved_work],
    instructions="You are the front desk; refunds need a person.",
    handoffs=[refunds],
)
