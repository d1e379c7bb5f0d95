"""Agents for the Flower test (``tests/crash/test_flower.py``): one run that finishes, one that parks, one that retries.

Workers import this module through ``LOUSHO_AGENTS=tests.support.flower_agents``. Every prompt, tool
argument, tool output and final text carries a marker (``MARKERS``) that the test looks for in Flower's
page: none may show there.

``scout``    one model turn with two ``tide`` calls, one tool batch, then a final answer.
``breaker``  one model turn with a ``jam`` call; ``jam`` raises a non-retryable ``PropagatingToolError``, so the
             tool batch parks the run.
``flaky``    like ``breaker``, but its ``wobble`` call fails once as retryable (marker file next to the test log),
             so the batch is recorded for a retry and the run finishes on the next try.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.checker import LOG_ENV
from worker import Agent, PropagatingToolError, ToolContext, tool
from worker.providers import MockModel

SCOUT, BREAKER, FLAKY = "scout", "breaker", "flaky"
PROMPT_MARK = "prompt-mark-5c1e"
ARGS_MARK = "args-mark-9d07"
OUTPUT_MARK = "output-mark-3b6f"
FINAL_MARK = "final-mark-e24a"
#: Text that is a prompt, a tool argument, a tool output or a model output: Flower must show none of it.
MARKERS = (PROMPT_MARK, ARGS_MARK, OUTPUT_MARK, FINAL_MARK)


def prompt(session_id: str) -> str:
    """The first user message of a run (carries the prompt marker)."""
    return f"{PROMPT_MARK} {session_id}: when is high tide?"


def _turn_with(*names: str) -> dict[str, object]:
    calls = [{"name": name, "args": {"place": f"{ARGS_MARK}-{index}"}} for index, name in enumerate(names)]
    return {"text": "checking the tides", "tool_calls": calls}


@tool
def tide(place: str, ctx: ToolContext) -> str:
    """The tide at ``place`` (its output carries the output marker)."""
    return f"{OUTPUT_MARK}: high tide at {place} at six"


@tool
def jam(place: str, ctx: ToolContext) -> str:
    """Always stops the run: the step fails for good and the run parks."""
    raise PropagatingToolError(f"{OUTPUT_MARK}: the gauge at {place} is jammed")


def _first_try_marker(session_id: str) -> Path:
    return Path(os.environ.get(LOG_ENV) or "/tmp/lousho-flower.jsonl").with_name(f"wobble-{session_id}")


@tool
def wobble(place: str, ctx: ToolContext) -> str:
    """Fails once per run (a retryable stop, recorded for a retry), then answers."""
    try:
        os.close(os.open(_first_try_marker(ctx.session_id), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return f"{OUTPUT_MARK}: high tide at {place} at seven"
    raise PropagatingToolError(f"{OUTPUT_MARK}: the gauge at {place} wobbles", retryable=True)


scout = Agent(
    name=SCOUT,
    model=MockModel([_turn_with("tide", "tide"), f"{FINAL_MARK}: six"]),
    instructions="Answer tide questions.",
    tools=[tide],
)
breaker = Agent(
    name=BREAKER,
    model=MockModel([_turn_with("jam"), f"{FINAL_MARK}: never"]),
    instructions="Answer tide questions.",
    tools=[jam],
)
flaky = Agent(
    name=FLAKY,
    model=MockModel([_turn_with("wobble"), f"{FINAL_MARK}: seven"]),
    instructions="Answer tide questions.",
    tools=[wobble],
)
