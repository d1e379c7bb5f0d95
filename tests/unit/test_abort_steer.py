"""Abort and steer in the step machine and the step, on the in-memory runtime (no services)."""

from __future__ import annotations

import json
import threading
from typing import Any

from store.memory import MemoryLeaseManager
from store.records import Checkpoint, InboxEntry, Lease, Message, ToolCall
from tests.fakes.clock import FakeClock
from tests.fakes.runtime import TTL_MS, MemoryRuntime
from worker import Agent, machine, tool
from worker.live import Live
from worker.providers import MockModel
from worker.steps import Outcome


def _call(call_id: str) -> ToolCall:
    return ToolCall(id=call_id, name="ship", args={})


def _paused_turn(**fields: Any) -> Checkpoint:
    turn = Message(role="assistant", tool_calls=[_call("a"), _call("b"), _call("c")])
    done = Message(role="tool", tool_call_id="b", name="ship", content="shipped")
    return Checkpoint(session_id="r", agent="shop", messages=[Message(role="user", content="go"), turn, done], **fields)


def test_an_aborted_checkpoint_gives_every_open_call_a_cancelled_result_in_call_order() -> None:
    stopped = machine.aborted(_paused_turn(status="awaiting-approval", approval_ids=["ap1"]), [], instructions="")
    assert [m.tool_call_id for m in stopped.messages if m.role == "tool"] == ["a", "b", "c"]
    assert [json.loads(m.content)["kind"] for m in stopped.messages if m.tool_call_id in ("a", "c")] == [
        "cancelled",
        "cancelled",
    ]
    assert (stopped.status, stopped.aborted, stopped.finish_reason, stopped.approval_ids) == (
        "in-progress",
        True,
        "aborted",
        [],
    )
    assert machine.transcript_problems(stopped.messages) == []


def test_queued_input_is_kept_after_the_cancelled_results() -> None:
    stopped = machine.aborted(
        _paused_turn(), [InboxEntry(n=1, messages=[Message(role="user", content="more")])], instructions=""
    )
    assert stopped.messages[-1].content == "more" and stopped.inbox_cursor == 1


def test_an_aborted_run_rests_until_input_comes_and_then_moves_without_the_abort() -> None:
    stopped = machine.aborted(_paused_turn(), [], instructions="")
    assert machine.plan(stopped, [], instructions="", max_steps=10) == machine.Idle("aborted")
    action = machine.plan(
        stopped, [InboxEntry(n=1, messages=[Message(role="user", content="again")])], instructions="", max_steps=10
    )
    assert isinstance(action, machine.ModelTurn)
    assert not action.checkpoint.aborted and action.checkpoint.finish_reason is None
    resumed = machine.plan(stopped.model_copy(update={"aborted": False}), [], instructions="", max_steps=10)
    assert isinstance(resumed, machine.ModelTurn) and resumed.checkpoint.finish_reason is None


def test_a_model_call_is_cut_short_by_a_steer_only_before_it_emitted_anything() -> None:
    lease = Lease("r", "owner", 1)
    live = Live(None, lease)
    live.cursor = 2
    assert not live.cancelled.is_set()
    lease.hear(watched=False, abort=False, steer=2)  # the input this turn already merged
    assert not live.cancelled.is_set()
    lease.hear(watched=False, abort=False, steer=3)
    assert live.cancelled.is_set()
    live.emitted = True
    assert not live.cancelled.is_set()
    lease.hear(watched=False, abort=True, steer=3)
    assert live.cancelled.is_set() and live.cancelled.wait(0)


def test_the_cut_short_wait_returns_when_a_signal_arrives() -> None:
    lease = Lease("r", "owner", 1)
    live = Live(None, lease)
    threading.Timer(0.05, lambda: lease.hear(watched=False, abort=True, steer=0)).start()
    assert live.cancelled.wait(5)
    assert not Live(None, Lease("s", "o", 1)).cancelled.wait(0.01)


@tool
def ship() -> str:
    """Ship."""
    return "shipped"


def test_a_step_settles_an_abort_requested_between_steps() -> None:
    runtime = MemoryRuntime.build(
        [
            Agent(
                name="shop",
                model=MockModel([{"tool_calls": [{"name": "ship"}, {"name": "ship"}]}, "done"]),
                tools=[ship],
            )
        ]
    )
    runtime.send("r-1", "shop", "ship it")
    assert runtime.step("r-1") == Outcome.ADVANCED  # the model turn
    assert runtime.store.request_abort("r-1") is True
    assert runtime.step("r-1") == Outcome.ABORTED
    stopped = runtime.checkpoint("r-1")
    assert stopped.aborted and [json.loads(m.content)["kind"] for m in stopped.messages if m.role == "tool"] == [
        "cancelled",
        "cancelled",
    ]
    assert [e.type for e in runtime.store.read_events("r-1", -1)][-3:] == ["tool.error", "tool.error", "run.done"]
    assert runtime.step("r-1") == Outcome.IDLE  # nothing moves it
    runtime.send("r-1", "shop", "go on")
    runtime.drain()
    assert runtime.checkpoint("r-1").finish_reason == "stop"


def test_an_abort_keeps_input_queued_before_it_and_reports_every_cancelled_call() -> None:
    runtime = MemoryRuntime.build(
        [
            Agent(
                name="shop",
                model=MockModel([{"tool_calls": [{"name": "ship"}, {"name": "ship"}]}, "done"]),
                tools=[ship],
            )
        ]
    )
    runtime.send("r-2", "shop", "ship it")
    runtime.step("r-2")
    runtime.send("r-2", "shop", "and tell me")
    runtime.store.request_abort("r-2")
    assert runtime.step("r-2") == Outcome.ABORTED
    events = runtime.store.read_events("r-2", -1)
    assert [e.type for e in events][-4:] == ["run.start", "tool.error", "tool.error", "run.done"]
    assert runtime.checkpoint("r-2").messages[-1].content == "and tell me"


class _KeptLeases(MemoryLeaseManager):
    """In-memory leases that keep every lease they give, so a test can ring its doorbell mid-step."""

    def __init__(self, ttl_ms: int, clock: FakeClock) -> None:
        super().__init__(ttl_ms, clock)
        self.given: list[Lease] = []

    def acquire(self, session_id: str, floor: int = 0) -> Lease | None:
        lease = super().acquire(session_id, floor)
        if lease is not None:
            self.given.append(lease)
        return lease


def test_a_doorbell_without_a_stored_abort_request_stops_nothing() -> None:
    clock = FakeClock()
    leases = _KeptLeases(TTL_MS, clock)

    def ring() -> None:  # what the heartbeat does when it reads an abort signal in Redis
        leases.given[-1].hear(watched=False, abort=True, steer=0)

    @tool
    def pack() -> str:
        """Pack."""
        ring()
        return "packed"

    def answer(messages: list[Message]) -> Any:
        ring()
        if not any(m.role == "assistant" for m in messages):
            return {"tool_calls": [{"name": "pack"}, {"name": "pack"}]}
        return "done"

    runtime = MemoryRuntime.build(
        [Agent(name="shop", model=MockModel(answer), tools=[pack])], leases=leases, clock=clock
    )
    runtime.send("r-3", "shop", "pack it")
    # Given no abort stored for the run, when its doorbell rings during the model call and during each tool call
    assert runtime.step("r-3") == Outcome.ADVANCED
    assert runtime.step("r-3") == Outcome.ADVANCED
    runtime.drain()
    # Then the turn is kept, both calls run and the run finishes
    done = runtime.checkpoint("r-3")
    assert not done.aborted and done.finish_reason == "stop"
    assert [m.content for m in done.messages if m.role == "tool"] == ["packed", "packed"]
