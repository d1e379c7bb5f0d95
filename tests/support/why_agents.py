"""Agents of the browser tests of a run's why (``tests/crash/test_ui_run_why.py``), on scripted ``MockModel``s.

Workers import this module beside the other agents of the page tests (``tests.support.ui_fixtures.UI_AGENTS``).

- ``staller``: its provider answers 429 with a ``Retry-After`` of ``RETRY_AFTER_S`` on every call, so the run
  stays retrying for longer than a test lasts.
- ``foreman`` (a lead) asks one ``task`` of ``clerk`` and ends ``overseen: <its result>``.
- ``clerk`` (its child) asks the gated ``file_form`` once, then ends ``filed``: while a person has not decided it,
  the clerk awaits approval and the foreman waits on it.
"""

from __future__ import annotations

from typing import Any

from store import errors
from store.records import Message
from worker import Agent, Tool
from worker.providers import MockModel

STALLER, FOREMAN, CLERK = "staller", "foreman", "clerk"
#: The staller's provider asks to be called again this much later (s): the retry is still ahead when a test ends.
RETRY_AFTER_S = 600.0


def _turn(messages: list[Message]) -> int:
    return sum(1 for m in messages if m.role == "assistant")


def _stall(messages: list[Message]) -> dict[str, Any]:
    raise errors.ProviderRateLimitedError("the provider is rate limited", retry_after=RETRY_AFTER_S)


def _oversee(messages: list[Message]) -> dict[str, Any]:
    if _turn(messages) == 0:
        return {
            "text": "one form to file",
            "tool_calls": [
                {
                    "id": "t-form",
                    "name": "task",
                    "args": {"agent": CLERK, "prompt": "file the form", "description": "file the form"},
                }
            ],
        }
    return {"text": f"overseen: {next(m.content for m in messages if m.role == 'tool')}"}


def _clerk(messages: list[Message]) -> dict[str, Any]:
    if _turn(messages) == 0:
        return {"text": "filing", "tool_calls": [{"id": "f-form", "name": "file_form", "args": {"form": "B-7"}}]}
    return {"text": "filed"}


def _file_form(form: str) -> str:
    """File a form (a person approves it first)."""
    return f"filed {form}"


file_form = Tool(_file_form, name="file_form", needs_approval=True)

staller = Agent(name=STALLER, model=MockModel(_stall, model_id="ui-mock"), instructions="Stall.", max_steps=5)
clerk = Agent(
    name=CLERK, model=MockModel(_clerk, model_id="ui-mock"), instructions="File.", tools=[file_form], max_steps=5
)
foreman = Agent(
    name=FOREMAN, model=MockModel(_oversee, model_id="ui-mock"), instructions="Oversee.", subagents=[clerk], max_steps=5
)
