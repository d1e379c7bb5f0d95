"""Spend budgets at their edge: a limit reached exactly is spent (no model call past it), one unit short is not."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from store.limits import Limits, Prices
from store.records import Checkpoint, Usage
from tests.fakes.runtime import MemoryRuntime
from worker import Agent, budgets, tool
from worker.providers import MockModel

NOW = datetime(2030, 1, 1, tzinfo=UTC)
PRICES = Prices(input=1_000_000.0, output=1_000_000.0)  # one unit of cost per token


def _spent(limits: Limits, usage: Usage, running_s: float = 0.0) -> str | None:
    checkpoint = Checkpoint(
        session_id="r", agent="a", usage=usage, clock_since=NOW - timedelta(seconds=running_s), clock_spent_s=0.0
    )
    return budgets.spent(limits, PRICES, checkpoint, NOW)


@pytest.mark.parametrize(
    ("limits", "short", "reached", "name"),
    [
        (Limits(max_input_tokens=100), Usage(input_tokens=99), Usage(input_tokens=100), "max_input_tokens"),
        (Limits(max_output_tokens=80), Usage(output_tokens=79), Usage(output_tokens=80), "max_output_tokens"),
        (
            Limits(max_cost=50.0),
            Usage(input_tokens=20, output_tokens=29),
            Usage(input_tokens=20, output_tokens=30),
            "max_cost",
        ),
    ],
)
def test_a_usage_limit_is_spent_when_reached_exactly(limits: Limits, short: Usage, reached: Usage, name: str) -> None:
    assert _spent(limits, short) is None
    assert _spent(limits, reached) == name


def test_the_duration_limit_is_spent_when_reached_exactly() -> None:
    limits = Limits(max_duration_s=30.0)
    assert _spent(limits, Usage(), running_s=29.999) is None
    assert _spent(limits, Usage(), running_s=30.0) == "max_duration_s"


@tool
def step_tool(n: int) -> str:
    """Do one unit of work."""
    return f"unit {n}"


def test_a_run_whose_turns_reach_the_limit_exactly_makes_no_further_model_call() -> None:
    usage = {"input_tokens": 10, "output_tokens": 40}
    script = [
        *[{"tool_calls": [{"name": "step_tool", "args": {"n": k}}], "usage": usage} for k in range(3)],
        {"text": "all done", "usage": usage},
    ]
    runtime = MemoryRuntime.build(
        [Agent(name="metered", model=MockModel(script), tools=[step_tool], limits=Limits(max_output_tokens=80))]
    )
    runtime.send("b-1", "metered", "work")
    runtime.drain()
    stopped = runtime.checkpoint("b-1")
    # Two turns of 40 reach 80 exactly: the third call is not made.
    assert (stopped.finish_reason, stopped.step, stopped.usage.output_tokens) == ("budget-exceeded", 2, 80)
