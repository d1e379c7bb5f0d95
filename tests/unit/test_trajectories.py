"""Where two runs diverge: ``compare_trajectories`` numbers steps as history and ``fork(from_step=...)`` do."""

from __future__ import annotations

from typing import Any

from producer import compare_trajectories
from tests.fakes.runtime import MemoryRuntime
from worker import Agent, tool
from worker.providers import MockModel


@tool
def weather(city: str) -> str:
    """The weather of a city."""
    return f"sunny in {city}"


def _trip() -> tuple[MemoryRuntime, list[dict[str, Any]]]:
    planner = Agent(
        name="planner",
        model=MockModel([{"tool_calls": [{"name": "weather", "args": {"city": "Oslo"}}]}, "Pack sunglasses."]),
        tools=[weather],
    )
    runtime = MemoryRuntime.build([planner])
    runtime.send("trip", "planner", "Plan my trip")
    runtime.drain()
    return runtime, [m.dump() for m in runtime.checkpoint("trip").messages]


def test_diverged_at_is_the_history_step_that_saved_the_first_differing_turn() -> None:
    # Given a run of two model turns, and the same transcript with another answer in its second turn
    runtime, saved = _trip()
    changed = [*saved[:-1], {**saved[-1], "content": "Pack an umbrella."}]
    # When the two are compared
    diff = compare_trajectories(saved, changed)
    # Then they diverge at step 2, the history step whose save holds that turn (the one a fork from it starts after)
    assert diff.diverged_at == 2
    at_step = [e for e in runtime.store.history("trip") if e.step == diff.diverged_at]
    assert at_step and at_step[0].checkpoint.messages[-1].content == "Pack sunglasses."
    before = [e for e in runtime.store.history("trip") if e.step == diff.diverged_at - 1]
    assert all(m.content != "Pack sunglasses." for e in before for m in e.checkpoint.messages)


def test_drift_names_steps_with_the_same_numbers() -> None:
    _, saved = _trip()
    other_city = [dict(m) for m in saved]
    turn = [m["role"] for m in saved].index("assistant")
    other_city[turn] = {**saved[turn], "tool_calls": [{**saved[turn]["tool_calls"][0], "args": {"city": "Rome"}}]}
    diff = compare_trajectories(saved, other_city)
    assert diff.diverged_at == 1
    assert diff.drift.arguments == [{"step": 1, "tool": "weather", "a": {"city": "Oslo"}, "b": {"city": "Rome"}}]
    first_turn = saved[: [m["role"] for m in saved].index("tool") + 1]
    longer = compare_trajectories(first_turn, saved)
    assert longer.diverged_at == 2 and longer.drift.step_count == {"a": 1, "b": 2}
    assert compare_trajectories(saved, saved).diverged_at is None
