"""A tool that raises ``PropagatingToolError`` stops the run: finished calls keep their results, the raising call
runs again on resume, and every other exception stays a result the model sees. Real services, steps in-process."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from producer.client import Client
from tests.support.driver import Driver
from worker import Agent, PropagatingToolError, ToolContext, tool
from worker.providers import MockModel
from worker.steps import Outcome

ran: list[str] = []
failing = {"count": 0}


@tool
def charge(order: str, ctx: ToolContext) -> str:
    """Charge an order."""
    ran.append(f"charge {order}")
    return f"charged {order}"


@tool
def ship(order: str, ctx: ToolContext) -> str:
    """Ship an order; the carrier is down the first time (the run must stop, not tell the model)."""
    ran.append(f"ship {order}")
    if failing["count"] > 0:
        failing["count"] -= 1
        raise PropagatingToolError("the carrier API is down; retry the run once it is back")
    return f"shipped {order}"


@tool
def label(order: str, ctx: ToolContext) -> str:
    """Print a label; an ordinary exception stays a result the model sees."""
    ran.append(f"label {order}")
    raise ValueError("printer jammed")


SCRIPT = [
    {
        "tool_calls": [
            {"name": "charge", "args": {"order": "7"}},
            {"name": "ship", "args": {"order": "7"}},
            {"name": "label", "args": {"order": "7"}},
        ]
    },
    "Order 7 charged, shipped and labelled.",
]


@pytest.fixture(autouse=True)
def _reset() -> None:
    ran.clear()
    failing["count"] = 1


def test_a_propagating_tool_error_stops_the_run_and_a_resume_runs_only_the_raising_call_and_the_rest(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(Agent(name="shop", model=MockModel(SCRIPT), tools=[charge, ship, label], tool_concurrency=1))
    run = client.agent("shop").send("charge and ship order 7", session_id="prop-1")
    driver.drain("prop-1")
    assert driver.outcomes[-1] == Outcome.PARKED
    assert ran == ["charge 7", "ship 7"]  # label never started
    with pytest.raises(PropagatingToolError) as raised:
        run.wait(timeout=5)
    assert "carrier API is down" in raised.value.message and raised.value.retryable is False
    checkpoint = client.agent("shop").load("prop-1")
    assert checkpoint is not None and checkpoint.status == "in-progress"
    assert [m.content for m in checkpoint.messages if m.role == "tool"] == ["charged 7"]
    pending = client.agent("shop").pending()
    assert [(p.session_id, p.state, p.last_error.code if p.last_error else None) for p in pending] == [
        ("prop-1", "parked", "LOUSHO_TOOL_PROPAGATED")
    ]
    events = [e.type for e in client.read_events("prop-1", -1)]
    assert events[-2:] == ["error", "run.done"]

    resumed = client.agent("shop").resume("prop-1")
    assert resumed is not None
    driver.drain("prop-1")
    assert resumed.wait(timeout=5).finish_reason == "stop"
    assert ran == ["charge 7", "ship 7", "ship 7", "label 7"]  # charge did not run again
    results = [m for m in client.agent("shop").load("prop-1").messages if m.role == "tool"]  # type: ignore[union-attr]
    assert [m.content for m in results[:2]] == ["charged 7", "shipped 7"]
    assert json.loads(results[2].content)["error"] == "ValueError"  # an ordinary exception: a result


def test_a_retryable_propagating_error_is_retried_with_backoff(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    @tool
    def flaky(order: str) -> str:
        """Ship through a flaky carrier."""
        ran.append(f"flaky {order}")
        if failing["count"] > 0:
            failing["count"] -= 1
            raise PropagatingToolError("carrier busy", retryable=True)
        return f"shipped {order}"

    driver = make_driver(
        Agent(
            name="shop2",
            model=MockModel([{"tool_calls": [{"name": "flaky", "args": {"order": "8"}}]}, "done"]),
            tools=[flaky],
        )
    )
    run = client.agent("shop2").send("ship 8", session_id="prop-2", check_agent=False)
    driver.drain("prop-2")
    assert Outcome.FAILED in driver.outcomes
    assert run.wait(timeout=5).finish_reason == "stop"
    assert ran == ["flaky 8", "flaky 8"]
