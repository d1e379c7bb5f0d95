"""What each step reports (``store.telemetry``): its kind, outcome and calls, and the trace context of its input."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest

from producer.client import Client
from store import telemetry
from store.limits import Limits
from tests.support.driver import Driver
from worker import Agent, tool
from worker.providers import MockModel

USAGE = {"input_tokens": 100, "output_tokens": 40}


@tool
def unit(n: int) -> str:
    """Do one unit of work."""
    return f"unit {n}"


@pytest.fixture
def traces() -> Iterator[list[str]]:
    """Trace contexts are made (as ``worker.tracing`` makes them) and listed in the order they were made."""
    made: list[str] = []
    numbers = itertools.count(1)

    def make() -> str:
        made.append(f"00-{next(numbers):032x}-{1:016x}-01")
        return made[-1]

    telemetry.use_traces(make)
    yield made
    telemetry.use_traces(None)


def test_each_step_reports_its_kind_calls_and_how_the_input_ended(
    make_driver: Callable[..., Driver], client: Client, traces: list[str]
) -> None:
    script = [
        {"tool_calls": [{"name": "unit", "args": {"n": 1}}, {"name": "unit", "args": {"n": 2}}], "usage": USAGE},
        {"text": "done", "usage": USAGE},
    ]
    driver = make_driver(Agent(name="reported", model=MockModel(script), tools=[unit]))
    run = client.agent("reported").send("go", session_id="rep-1")
    driver.drain("rep-1")
    assert run.wait(timeout=5).text == "done"
    first, batch, last = (r for r in driver.reports if r.outcome != "stale")
    assert (first.kind, first.agent, first.calls_asked, first.input_started) == ("model turn", "reported", 2, True)
    assert [(m.input_tokens, m.output_tokens) for m in first.model_calls] == [(100, 40)]
    assert first.summary() == "model turn: 2 tool calls"
    assert batch.kind == "tool batch" and [(t.tool, t.outcome) for t in batch.tool_calls] == [("unit", "ok")] * 2
    assert last.ended_as == "finished" and last.summary() == "model turn: answer; finished: stop"
    # One trace for the input, made by the step that merged it and carried by every later step.
    assert len(traces) == 1 and {first.trace, batch.trace, last.trace} == {traces[0]}


def test_a_resume_of_a_budget_stopped_input_starts_a_new_trace(
    make_driver: Callable[..., Driver], client: Client, traces: list[str]
) -> None:
    script = [
        *({"tool_calls": [{"name": "unit", "args": {"n": k}}], "usage": USAGE} for k in range(4)),
        {"text": "all done", "usage": USAGE},
    ]
    driver = make_driver(
        Agent(name="stopped", model=MockModel(script), tools=[unit], limits=Limits(max_output_tokens=100))
    )
    run = client.agent("stopped").send("work", session_id="rep-2")
    driver.drain("rep-2")
    assert run.wait(timeout=5).finish_reason == "budget-exceeded"
    assert driver.reports[-1].ended_as == "budget-exceeded"
    assert len(traces) == 1
    resumed = client.agent("stopped").resume("rep-2", limits=Limits(max_output_tokens=1000))
    assert resumed is not None
    driver.drain("rep-2")
    assert resumed.wait(timeout=5).finish_reason == "stop"
    # The stopped input's trace ended at the stop (its root span was made then): the resume goes on in another.
    assert len(traces) == 2
    assert driver.reports[-1].trace == traces[1] != traces[0]
