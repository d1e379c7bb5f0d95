"""``@tool(timeout=…)``: a call that runs too long gets a ``timeout`` result and the run goes on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest

from producer.client import Client
from store import errors
from tests.support.driver import Driver
from worker import Agent, ToolContext, tool
from worker.providers import MockModel

told: list[str] = []


@tool(timeout=0.3)
def stuck(key: str, ctx: ToolContext) -> str:
    """Hang on a remote call; stop when told."""
    if ctx.cancelled.wait(10):
        told.append(key)
    return f"{key} late"


@tool(timeout=5)
def quick(key: str) -> str:
    """Answer at once."""
    return f"{key} quick"


def test_a_call_past_its_timeout_gets_a_timeout_result_and_is_told_to_stop(
        make_driver: Callable[..., Driver], client: Client) -> None:
    told.clear()
    driver = make_driver(Agent(name="slowpoke", model=MockModel([
        {"tool_calls": [{"name": "stuck", "args": {"key": "a"}}, {"name": "quick", "args": {"key": "b"}}]},
        "gave up on a"]), tools=[stuck, quick], tool_concurrency=1))
    run = client.agent("slowpoke").send("go", session_id="timeout-1")
    started = time.monotonic()
    driver.drain("timeout-1")
    took = time.monotonic() - started
    result = run.wait(timeout=5)
    assert result.finish_reason == "stop" and took < 3.0
    results = [m for m in result.messages if m.role == "tool"]
    body = json.loads(results[0].content)
    assert (body["kind"], body["error"]) == ("timeout", "ToolTimedOut")
    assert results[1].content == "b quick"
    deadline = time.monotonic() + 2
    while not told and time.monotonic() < deadline:
        time.sleep(0.01)
    assert told == ["a"]  # the abandoned call heard ctx.cancelled
    assert threading.active_count() < 200


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(errors.ConfigurationError):
        tool(timeout=0)(lambda: None)
