"""Agents of the browser tests of the run pages (``tests/crash/test_ui_*.py``), each on a scripted ``MockModel``.

Workers import this module through ``LOUSHO_AGENTS=tests.support.ui_agents``. The model's call ids are
``MockModel``'s own (``call_<turn>_<k>``), so a test can name a call in a fork patch.

- ``payer`` asks for two ``pay`` calls in one turn, both needing approval; its last turn reports both results,
  ``paid: <result> | <result>``, once the test lets it (``release_marker``), so a page is open while it runs.
- ``booker`` asks ``ask_question`` (``QUESTION``, ``OPTIONS``) and answers ``booked <answer>``.
- ``plodder`` calls ``trudge`` once per turn: the first call works until the run is aborted (``TRUDGE_FIRST_MS``
  at most), the second briefly, then the run ends ``plodded: <last result>``.
- ``chooser`` looks up a colour, then a shade of it, then answers ``chose <shade>``: a fork that patches the
  second call's result (``call_1_0``) ends with another answer.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from store.records import Message
from tests.support.agents import log_event
from tests.support.checker import LOG_ENV
from worker import Agent, Tool, ToolContext, tool
from worker.providers import MockModel

PAYER, BOOKER, PLODDER, CHOOSER = "payer", "booker", "plodder", "chooser"
#: The two payees of the payer's turn (approve one, reject the other).
PAYEES = (("alice", 10), ("bob", 20))
#: The longest the payer's last turn waits for its release marker (under the test settings' soft step limit).
PAYER_HOLD_MAX_S = 6.0
QUESTION = "Which city should I book?"
OPTIONS = ["Oslo", "Rome"]
#: The most the plodder's first call works: it stops early when the run is aborted.
TRUDGE_FIRST_MS = 20_000
TRUDGE_SECOND_MS = 200
#: What ``lookup`` finds: the chooser's first call finds ``blue``, its second ``navy``.
SHADES = {"colour": "blue", "shade of blue": "navy", "shade of red": "crimson"}
#: The id of the chooser's second call (turn 1, first call), the one a fork patches.
SHADE_CALL_ID = "call_1_0"


def pay_prompt(session_id: str) -> str:
    """The payer's first user message: it names the run, whose release marker the last turn waits for."""
    return f"pay alice and bob, run {session_id}"


def release_marker(log_path: Path, session_id: str) -> Path:
    """The file whose creation lets the payer's last turn answer (beside the side-effect log)."""
    return log_path.with_name(f"release-{session_id}")


def _turn(messages: list[Message]) -> int:
    return sum(1 for m in messages if m.role == "assistant")


def _results(messages: list[Message]) -> list[str]:
    return [str(m.content) for m in messages if m.role == "tool"]


def _pay_script(messages: list[Message]) -> Any:
    if _turn(messages) == 0:
        calls = [{"name": "pay", "args": {"payee": payee, "amount": amount}} for payee, amount in PAYEES]
        return {"text": "two payments to make", "tool_calls": calls}
    _wait_for_release(str(next(m for m in messages if m.role == "user").content).split()[-1])
    return "paid: " + " | ".join(_results(messages))


def _wait_for_release(session_id: str) -> None:
    log_path = os.environ.get(LOG_ENV)
    if not log_path:
        return
    marker = release_marker(Path(log_path), session_id)
    deadline = time.monotonic() + PAYER_HOLD_MAX_S
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _pay(payee: str, amount: int) -> str:
    """Pay ``amount`` to ``payee`` (a person approves each payment first)."""
    return f"sent {amount} to {payee}"


pay = Tool(_pay, name="pay", needs_approval=True)


def _book_script(messages: list[Message]) -> Any:
    if _turn(messages) == 0:
        return {
            "text": "one question first",
            "tool_calls": [{"name": "ask_question", "args": {"question": QUESTION, "options": OPTIONS}}],
        }
    body = json.loads(_results(messages)[-1])
    said = body.get("answer") if isinstance(body, dict) else None
    return f"booked {said}" if said else f"not booked: {body}"


def _plod_script(messages: list[Message]) -> Any:
    turn = _turn(messages)
    if turn == 0:
        return {"text": "a long walk", "tool_calls": [{"name": "trudge", "args": {"ms": TRUDGE_FIRST_MS}}]}
    if turn == 1:
        return {"text": "a short walk", "tool_calls": [{"name": "trudge", "args": {"ms": TRUDGE_SECOND_MS}}]}
    return f"plodded: {_results(messages)[-1]}"


@tool
def trudge(ms: int, ctx: ToolContext) -> str:
    """Walk for ``ms`` milliseconds, stopping at once when the run is aborted (its start and end are logged)."""
    record = {"kind": "tool", "run_id": ctx.session_id, "tool_call_id": ctx.tool_call_id}
    log_event({**record, "phase": "start", "ms": ms})
    stopped = ctx.cancelled.wait(ms / 1000)
    log_event({**record, "phase": "end", "cancelled": stopped})
    return "stopped early" if stopped else f"walked {ms} ms"


def _choose_script(messages: list[Message]) -> Any:
    turn = _turn(messages)
    if turn == 0:
        return {"text": "which colour?", "tool_calls": [{"name": "lookup", "args": {"key": "colour"}}]}
    if turn == 1:
        return {
            "text": "which shade?",
            "tool_calls": [{"name": "lookup", "args": {"key": f"shade of {_results(messages)[-1]}"}}],
        }
    return f"chose {_results(messages)[-1]}"


@tool
def lookup(key: str, ctx: ToolContext) -> str:
    """What the table says about ``key``."""
    return SHADES.get(key, "unknown")


payer = Agent(
    name=PAYER, model=MockModel(_pay_script, model_id="ui-mock"), instructions="Pay people.", tools=[pay], max_steps=10
)
booker = Agent(
    name=BOOKER,
    model=MockModel(_book_script, model_id="ui-mock"),
    instructions="Book trips.",
    ask_question=True,
    max_steps=10,
)
#: One call at a time, so an abort finds the long call running.
plodder = Agent(
    name=PLODDER,
    model=MockModel(_plod_script, model_id="ui-mock"),
    instructions="Walk.",
    tools=[trudge],
    max_steps=10,
    tool_concurrency=1,
)
chooser = Agent(
    name=CHOOSER,
    model=MockModel(_choose_script, model_id="ui-mock"),
    instructions="Choose a shade.",
    tools=[lookup],
    max_steps=10,
)
