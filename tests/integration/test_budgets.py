"""Spend budgets: a run stops at a limit with ``budget-exceeded`` (in progress, left alone by the sweep), a resume
with a raised limit continues it, a follow-up starts from zero, and the run's clock leaves approval pauses out.
Real services, steps in-process."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from producer.client import Client, Run, RunResult
from store.limits import Limits, Prices
from tests.support.driver import Driver, postgres
from worker import Agent, ConfigurationError, tool
from worker.providers import MockModel

USAGE = {"input_tokens": 100, "output_tokens": 40}


@tool
def step_tool(n: int) -> str:
    """Do one unit of work."""
    return f"unit {n}"


@tool
def slow(n: int) -> str:
    """Take a while."""
    time.sleep(0.6)
    return f"slow {n}"


@tool(needs_approval=True)
def gated(n: int) -> str:
    """Wait for a person."""
    return f"gated {n}"


def _settle(run: Run, driver: Driver) -> RunResult:
    driver.drain(run.session_id)
    return run.wait(timeout=5)


def _script(name: str, turns: int) -> list[object]:
    calls: list[object] = [{"tool_calls": [{"name": name, "args": {"n": k}}], "usage": USAGE} for k in range(turns)]
    return [*calls, {"text": "all done", "usage": USAGE}]


def test_a_token_budget_stops_the_run_and_a_resume_with_a_raised_limit_finishes_it(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    agent = Agent(
        name="metered",
        model=MockModel(_script("step_tool", 4)),
        tools=[step_tool],
        limits=Limits(max_output_tokens=100),
    )
    driver = make_driver(agent)
    run = client.agent("metered").send("work", session_id="bud-1")
    driver.drain("bud-1")
    stopped = run.wait(timeout=5)
    assert stopped.finish_reason == "budget-exceeded"
    assert stopped.steps == 3 and stopped.usage.output_tokens == 120  # checked before each call: 3 x 40 >= 100
    checkpoint = client.agent("metered").load("bud-1")
    assert checkpoint is not None and checkpoint.status == "in-progress"
    # The sweep leaves it alone: nothing is due, and a stray step does nothing.
    assert "bud-1" not in [d.session_id for d in postgres(client.store).due_runs(0.0)]
    driver.drain("bud-1")
    assert client.agent("metered").load("bud-1").seq == checkpoint.seq  # type: ignore[union-attr]
    (listed,) = client.agent("metered").pending()
    assert (listed.session_id, listed.state) == ("bud-1", "budget-exceeded")
    events = [e for e in client.read_events("bud-1", -1) if e.type == "run.done"]
    assert events[-1].data["finish_reason"] == "budget-exceeded"

    resumed = client.agent("metered").resume("bud-1", limits=Limits(max_output_tokens=1000))
    assert resumed is not None
    driver.drain("bud-1")
    finished = resumed.wait(timeout=5)
    assert finished.finish_reason == "stop" and finished.text == "all done" and finished.steps == 5


def test_a_follow_up_starts_its_budget_from_zero(make_driver: Callable[..., Driver], client: Client) -> None:
    script = [
        {"tool_calls": [{"name": "step_tool", "args": {"n": 0}}], "usage": USAGE},
        {"text": "one", "usage": USAGE},
        {"text": "two", "usage": USAGE},
    ]
    driver = make_driver(
        Agent(name="per-input", model=MockModel(script), tools=[step_tool], limits=Limits(max_input_tokens=150))
    )
    first = _settle(client.agent("per-input").send("a", session_id="bud-2"), driver)
    # Checked before each call: 0, then 100, are under 150; the input ends having spent 200.
    assert (first.finish_reason, first.steps, first.usage.input_tokens) == ("stop", 2, 200)
    # Carried over, those 200 would stop the follow-up before its first call; counted alone, it spends 100.
    second = _settle(client.agent("per-input").send("b", session_id="bud-2"), driver)
    assert (second.finish_reason, second.text, second.steps, second.usage.input_tokens) == ("stop", "two", 1, 100)


def test_max_cost_counts_with_the_agent_prices(make_driver: Callable[..., Driver], client: Client) -> None:
    prices = Prices(input=1_000.0, output=10_000.0)  # per million tokens: one turn costs 0.1 + 0.4
    agent = Agent(
        name="priced",
        model=MockModel(_script("step_tool", 3)),
        tools=[step_tool],
        limits=Limits(max_cost=0.9),
        prices=prices,
    )
    driver = make_driver(agent)
    stopped = _settle(client.agent("priced").send("work", session_id="bud-3"), driver)
    assert stopped.finish_reason == "budget-exceeded" and stopped.steps == 2
    with pytest.raises(ConfigurationError, match="prices"):
        Agent(name="unpriced", model=MockModel(["x"]), limits=Limits(max_cost=1.0))


def test_the_duration_budget_counts_running_time_and_leaves_approval_pauses_out(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    script = [
        {"tool_calls": [{"name": "gated", "args": {"n": 0}}]},
        {"tool_calls": [{"name": "slow", "args": {"n": 1}}]},
        {"tool_calls": [{"name": "slow", "args": {"n": 2}}]},
        "done",
    ]
    driver = make_driver(
        Agent(name="timed", model=MockModel(script), tools=[gated, slow], limits=Limits(max_duration_s=1.0))
    )
    client.agent("timed").send("work", session_id="bud-4")
    driver.drain("bud-4")
    (approval,) = client.agent("timed").approvals.list()
    time.sleep(1.5)  # longer than the whole budget: a pause does not count
    client.agent("timed").approvals.resolve(approval.approval_id, approved=True)
    driver.drain("bud-4")
    checkpoint = client.agent("timed").load("bud-4")
    assert checkpoint is not None and checkpoint.finish_reason == "budget-exceeded"
    assert checkpoint.step == 3  # two slow calls ran (1.2 s) before the third model call was refused
    assert checkpoint.clock_since is None and 1.0 <= (checkpoint.clock_spent_s or 0) < 1.45
