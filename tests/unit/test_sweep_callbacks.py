"""``on_recovered`` and ``on_error`` on an agent: the sweep tells it, once, how each run it sent on came out."""

from __future__ import annotations

from typing import Any

import pytest

from store import errors
from store.records import LastError, Message, SweptRun
from tests.fakes.runtime import TTL_MS, MemoryRuntime
from worker import Agent, recovery, tool
from worker.providers import MockModel, ModelResponse, ToolSpec
from worker.steps import Outcome

SID = "order-7"


@tool
def ship(order: int) -> str:
    """Ship the order."""
    return f"shipped {order}"


class _Heard:
    """What the callbacks were told."""

    def __init__(self) -> None:
        self.recovered: list[SweptRun] = []
        self.failed: list[tuple[LastError, SweptRun]] = []

    def on_recovered(self, run: SweptRun) -> None:
        self.recovered.append(run)

    def on_error(self, error: LastError, run: SweptRun) -> None:
        self.failed.append((error, run))


class _FailsAfterTurnOne:
    """Answers the first turn, then refuses every later request for good (a 400 from the provider)."""

    model_id = "refusing"

    def __init__(self) -> None:
        self.inner = MockModel([{"tool_calls": [{"name": "ship", "args": {"order": 7}}]}, "Shipped."])

    def generate(self, messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        if any(m.role == "tool" for m in messages):
            raise errors.ProviderError("400 bad request", retryable=False)
        return self.inner.generate(messages, tools)


def _stalled(model: Any = None) -> tuple[MemoryRuntime, _Heard]:
    """A run whose step message after its first turn was lost, silent for a lease TTL: the sweep's to send on."""
    heard = _Heard()
    agent = Agent(
        "shop",
        model or MockModel([{"tool_calls": [{"name": "ship", "args": {"order": 7}}]}, "Shipped."]),
        tools=[ship],
        on_recovered=heard.on_recovered,
        on_error=heard.on_error,
    )
    runtime = MemoryRuntime.build([agent])
    runtime.send(SID, "shop", "Ship order 7")
    first = runtime.queue.pop()
    assert runtime.step(first.session_id, first.seq) == Outcome.ADVANCED
    runtime.queue.pop()  # the next step's message is lost
    runtime.clock.advance(ms=TTL_MS + 1)
    return runtime, heard


def test_a_run_the_sweep_sent_on_is_reported_recovered_once_when_its_input_ends() -> None:
    # Given a stalled run the sweep sends on
    runtime, heard = _stalled()
    assert runtime.sweep() == 1
    assert recovery.report(runtime.store, runtime.deps.agents) == 0  # still moving: nothing to tell yet
    # When it finishes, then the next sweep tells the agent, and no sweep after it tells it again
    assert runtime.drain()[-1] == Outcome.FINISHED
    assert recovery.report(runtime.store, runtime.deps.agents) == 1
    assert recovery.report(runtime.store, runtime.deps.agents) == 0
    (run,) = heard.recovered
    assert (run.session_id, run.agent, run.status, run.finish_reason) == (SID, "shop", "finished", "stop")
    assert heard.failed == []


def test_a_run_the_sweep_sent_on_that_then_fails_is_reported_as_an_error_once() -> None:
    runtime, heard = _stalled(_FailsAfterTurnOne())
    assert runtime.sweep() == 1
    assert runtime.drain()[-1] == Outcome.PARKED
    assert recovery.report(runtime.store, runtime.deps.agents) == 1
    assert recovery.report(runtime.store, runtime.deps.agents) == 0
    ((error, run),) = heard.failed
    assert run.session_id == SID and error.retryable is False and error.code == "LOUSHO_PROVIDER_REQUEST_FAILED"
    assert heard.recovered == []


def test_runs_the_sweep_never_sent_and_agents_not_served_here_are_not_reported() -> None:
    # A run that finished on its own is no recovery
    heard = _Heard()
    agent = Agent("shop", MockModel(["Hi."]), on_recovered=heard.on_recovered, on_error=heard.on_error)
    runtime = MemoryRuntime.build([agent])
    runtime.send("plain", "shop", "hi")
    runtime.drain()
    assert recovery.report(runtime.store, runtime.deps.agents) == 0
    # A recovered run whose agent this worker does not load waits for a sweep on a worker that does
    stalled, other = _stalled()
    stalled.sweep()
    stalled.drain()
    assert recovery.report(stalled.store, {}) == 0
    assert recovery.report(stalled.store, stalled.deps.agents) == 1 and len(other.recovered) == 1


def test_a_callback_that_raises_is_logged_and_the_sweep_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    runtime, _ = _stalled()

    def broken(run: SweptRun) -> None:
        raise RuntimeError("the pager is down")

    runtime.deps.agents["shop"].on_recovered = broken
    runtime.sweep()
    runtime.drain()
    assert recovery.report(runtime.store, runtime.deps.agents) == 1
    assert "on_recovered of agent shop failed for order-7: RuntimeError" in caplog.text


def test_callbacks_must_be_callable() -> None:
    with pytest.raises(errors.ConfigurationError):
        Agent("shop", MockModel(["Hi."]), on_recovered="notify")  # type: ignore[arg-type]
