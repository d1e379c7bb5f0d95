"""Agents of the browser tests of a run's tree, usage and drawing (``tests/crash/test_ui_run_drawing.py``).

Workers import this module beside ``tests.support.ui_agents`` (``tests.support.ui_fixtures.UI_AGENTS``). Models are
scripted ``MockModel``s with scripted usage, so a test can add usage up.

- ``drafter`` (a lead) asks two ``task`` calls of ``scout`` in its first turn, ``deep`` and ``shallow``, then ends
  ``drafted: <each child's first line>``.
- ``scout`` (a child, and a lead itself): ``deep`` asks one ``task`` call of ``digger``; ``shallow`` one ``measure``
  call of ``SHALLOW_MS``; then ``scouted``.
- ``digger`` (a grandchild): one ``measure`` call of ``DIG_MS``, then ``dug``.
- ``surveyor`` draws every kind of bar: its first model call fails once with a transient provider error (a retry
  wait), then it asks ``measure`` (``SURVEY_MS``) and the gated ``stamp``; once a person approves the stamp (an
  approval wait) it asks one ``task`` of ``digger`` (a children wait), then ends ``surveyed``. It has prices
  (``SURVEY_PRICES``), the others none.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from store.records import Message
from tests.support.checker import LOG_ENV
from worker import Agent, Prices, Tool, tool
from worker.providers import MockModel

DRAFTER, SCOUT, DIGGER, SURVEYOR = "drafter", "scout", "digger", "surveyor"
SHALLOW_MS, DIG_MS, SURVEY_MS = 300, 200, 700
#: What each model turn reports it used (the run's usage adds these up).
TURN_USAGE = {"input_tokens": 120, "output_tokens": 30}
#: The surveyor's prices (per million tokens): its workers record each turn's cost.
SURVEY_PRICES = Prices(input=2.5, output=10.0)


def _turn(messages: list[Message]) -> int:
    return sum(1 for m in messages if m.role == "assistant")


def _prompt(messages: list[Message]) -> str:
    return str(next(m.content for m in messages if m.role == "user"))


def _task(call_id: str, agent: str, prompt: str) -> dict[str, Any]:
    return {"id": call_id, "name": "task", "args": {"agent": agent, "prompt": prompt, "description": prompt}}


def _draft(messages: list[Message]) -> dict[str, Any]:
    if _turn(messages) == 0:
        return {
            "text": "two scouts",
            "usage": TURN_USAGE,
            "tool_calls": [_task("t-deep", SCOUT, "deep"), _task("t-shallow", SCOUT, "shallow")],
        }
    found = " | ".join(str(m.content).splitlines()[0] for m in messages if m.role == "tool")
    return {"text": f"drafted: {found}", "usage": TURN_USAGE}


def _scout(messages: list[Message]) -> dict[str, Any]:
    if _turn(messages) > 0:
        return {"text": "scouted", "usage": TURN_USAGE}
    if _prompt(messages) == "deep":
        return {"text": "dig deeper", "usage": TURN_USAGE, "tool_calls": [_task("t-dig", DIGGER, "dig")]}
    return {
        "text": "measure it",
        "usage": TURN_USAGE,
        "tool_calls": [{"id": "m-shallow", "name": "measure", "args": {"ms": SHALLOW_MS}}],
    }


def _dig(messages: list[Message]) -> dict[str, Any]:
    if _turn(messages) > 0:
        return {"text": "dug", "usage": TURN_USAGE}
    return {
        "text": "measure the hole",
        "usage": TURN_USAGE,
        "tool_calls": [{"id": "m-dig", "name": "measure", "args": {"ms": DIG_MS}}],
    }


def failed_once_marker(session_id: str) -> Path | None:
    """The file that says the surveyor's first model call of ``session_id`` already failed once."""
    log_path = os.environ.get(LOG_ENV)
    return Path(log_path).with_name(f"failed-once-{session_id}") if log_path else None


def _survey(messages: list[Message]) -> dict[str, Any]:
    turn = _turn(messages)
    if turn == 0:
        marker = failed_once_marker(_prompt(messages).split()[-1])
        if marker is not None and not marker.exists():
            marker.touch()
            return {"error": "the provider is busy", "retryable": True}
        return {
            "text": "measure and stamp",
            "usage": TURN_USAGE,
            "tool_calls": [
                {"id": "m-survey", "name": "measure", "args": {"ms": SURVEY_MS}},
                {"id": "s-survey", "name": "stamp", "args": {"page": 1}},
            ],
        }
    if turn == 1:
        return {"text": "one more hole", "usage": TURN_USAGE, "tool_calls": [_task("t-survey", DIGGER, "dig")]}
    return {"text": "surveyed", "usage": TURN_USAGE}


@tool
def measure(ms: int) -> str:
    """Measure for ``ms`` milliseconds."""
    time.sleep(ms / 1000)
    return f"measured {ms} ms"


def _stamp(page: int) -> str:
    """Stamp a page (a person approves it first)."""
    return f"stamped page {page}"


stamp = Tool(_stamp, name="stamp", needs_approval=True)

digger = Agent(
    name=DIGGER, model=MockModel(_dig, model_id="ui-mock"), instructions="Dig.", tools=[measure], max_steps=10
)
scout = Agent(
    name=SCOUT,
    model=MockModel(_scout, model_id="ui-mock"),
    instructions="Scout.",
    tools=[measure],
    subagents=[digger],
    max_subagent_depth=2,
    max_steps=10,
)
drafter = Agent(
    name=DRAFTER,
    model=MockModel(_draft, model_id="ui-mock"),
    instructions="Draft.",
    subagents=[scout],
    max_subagent_depth=2,
    tool_concurrency=2,
    max_steps=10,
)
surveyor = Agent(
    name=SURVEYOR,
    model=MockModel(_survey, model_id="ui-mock"),
    instructions="Survey.",
    tools=[measure, stamp],
    subagents=[digger],
    tool_concurrency=1,
    max_steps=10,
    prices=SURVEY_PRICES,
)
