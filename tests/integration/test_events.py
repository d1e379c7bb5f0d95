"""A run's durable events, live signals, abort and steer, on the real services with steps run in-process."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from producer.client import Client
from store import errors, keys
from store.checkpoints import PostgresCheckpointStore
from store.events import Event
from store.records import Message
from tests.support.driver import Driver
from worker import Agent, ToolContext, tool
from worker.providers import MockModel
from worker.steps import Outcome

SLOW_S = 0.6
#: Longest a test waits for the slow tool to start (a deadline, not a pause).
START_TIMEOUT_S = 10.0
started: list[str] = []
finished: list[str] = []
#: Notified each time ``slow`` starts, so a test waits on it instead of polling.
_starts = threading.Condition()


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return f"{key}=1"


@tool
def slow(key: str, ctx: ToolContext) -> str:
    """Work for a while; stop early when the run is aborted."""
    with _starts:
        started.append(key)
        _starts.notify_all()
    if ctx.cancelled.wait(SLOW_S):
        return f"{key} stopped"
    finished.append(key)
    return f"{key} done"


@tool(needs_approval=True)
def pay(amount: int) -> str:
    """Pay; a human approves it."""
    return f"paid {amount}"


@pytest.fixture(autouse=True)
def _reset() -> None:
    started.clear()
    finished.clear()


def _calls(*names: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"tool_calls": [{"name": name, "args": args} for name, args in names]}


def _all(iterator: Iterator[Event]) -> list[Event]:
    return list(iterator)


def _wait_started(count: int) -> None:
    """Until ``count`` slow calls have started; fails after ``START_TIMEOUT_S``."""
    with _starts:
        assert _starts.wait_for(lambda: len(started) >= count, START_TIMEOUT_S), (
            f"{count} slow call(s) did not start within {START_TIMEOUT_S} s: {started}"
        )


def _watching(redis_client: redis.Redis, session_id: str) -> None:
    """Until a reader of the run is subscribed and watching (it sets the watch key once subscribed)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not redis_client.exists(keys.watch_key(session_id)):
        assert time.monotonic() < deadline, f"no reader of {session_id} watched within {START_TIMEOUT_S} s"
        time.sleep(0.01)


def _in_thread(work: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def _transcript_matches(events: list[Event], messages: list[Message]) -> None:
    """Every result of the transcript has exactly one tool event, every model turn one step.done."""
    results = [m for m in messages if m.role == "tool"]
    tool_events = [e for e in events if e.type in ("tool.done", "tool.error")]
    assert sorted(e.data["tool_call_id"] for e in tool_events) == sorted(str(m.tool_call_id) for m in results)
    for event in tool_events:
        message = next(m for m in results if m.tool_call_id == event.data["tool_call_id"])
        assert event.data["result"] == message.content
        assert (event.type == "tool.error") == bool(message.is_error)
    turns = [m for m in messages if m.role == "assistant"]
    assert [e.data["text"] for e in events if e.type == "step.done"] == [m.content for m in turns]


def test_a_run_writes_its_events_with_its_saves_gapless_and_matching_the_transcript(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(
        Agent(
            name="ev",
            model=MockModel([_calls(("lookup", {"key": "a"}), ("lookup", {"key": "b"})), "all looked up"]),
            tools=[lookup],
        )
    )
    run = client.agent("ev").send("look", session_id="ev-1")
    driver.drain("ev-1")
    seen = _all(run.events(timeout=5))
    assert [e.type for e in seen] == ["run.start", "step.done", "tool.done", "tool.done", "step.done", "run.done"]
    assert [e.seq for e in seen] == list(range(6))
    assert all(e.run_id == "ev-1" and e.v == 1 and e.at.tzinfo is not None for e in seen)
    assert seen[0].data == {"agent": "ev", "input_number": 1, "resumed": False}
    assert seen[1].data["tool_calls"][0]["name"] == "lookup" and seen[1].data["step"] == 1
    assert seen[-1].data["finish_reason"] == "stop" and seen[-1].data["text"] == "all looked up"
    checkpoint = client.agent("ev").load("ev-1")
    assert checkpoint is not None
    _transcript_matches(seen, checkpoint.messages)
    # A consumer picking up after seq 2 gets exactly the rest.
    assert [e.seq for e in client.agent("ev").events("ev-1", after=2, timeout=5)] == [3, 4, 5]


def test_a_second_input_continues_the_numbering_and_its_handle_starts_at_its_own_run_start(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(Agent(name="ev", model=MockModel(["first", "second"])))
    client.agent("ev").send("one", session_id="ev-2")
    driver.drain("ev-2")
    second = client.agent("ev").send("two", session_id="ev-2")
    driver.drain("ev-2")
    seen = _all(second.events(timeout=5))
    assert [(e.seq, e.type) for e in seen] == [(3, "run.start"), (4, "step.done"), (5, "run.done")]
    assert seen[0].data["input_number"] == 2 and seen[-1].data["text"] == "second"
    # Without a position, a reader starts at the latest run.start.
    assert [e.seq for e in client.events("ev-2", timeout=5)] == [3, 4, 5]


def test_inputs_merged_by_one_step_are_each_read_from_the_run_start_that_merged_them(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(Agent(name="ev", model=MockModel(["first", "both"])))
    client.agent("ev").send("one", session_id="ev-2m")
    driver.drain("ev-2m")
    two = client.agent("ev").send("two", session_id="ev-2m")
    three = client.agent("ev").send("three", session_id="ev-2m")
    driver.drain("ev-2m")  # one step merges both
    for handle in (two, three):
        seen = _all(handle.events(timeout=3))
        assert [(e.seq, e.type) for e in seen] == [(3, "run.start"), (4, "step.done"), (5, "run.done")]
        assert seen[0].data["input_number"] == 3 and seen[-1].data["text"] == "both"


def test_a_reader_blocks_until_the_events_are_saved(
    make_driver: Callable[..., Driver], client: Client, redis_client: redis.Redis
) -> None:
    driver = make_driver(Agent(name="ev", model=MockModel([_calls(("lookup", {"key": "a"})), "done"]), tools=[lookup]))
    run = client.agent("ev").send("look", session_id="ev-3")
    got: list[Event] = []
    reader = _in_thread(lambda: got.extend(run.events(timeout=10)))
    _watching(redis_client, "ev-3")
    assert got == [] and reader.is_alive()  # nothing saved yet: the reader waits
    driver.drain("ev-3")
    reader.join(10)
    assert [e.type for e in got][-1] == "run.done" and got[0].type == "run.start"


def test_a_reader_times_out_without_losing_its_place(make_driver: Callable[..., Driver], client: Client) -> None:
    make_driver(Agent(name="ev", model=MockModel(["x"])))
    run = client.agent("ev").send("hi", session_id="ev-4")
    with pytest.raises(errors.RunTimeoutError):
        _all(run.events(timeout=0.3))


def test_approvals_pauses_and_decisions_are_events(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(
        Agent(
            name="ev",
            model=MockModel([_calls(("lookup", {"key": "a"}), ("pay", {"amount": 5})), "paid"]),
            tools=[lookup, pay],
        )
    )
    run = client.agent("ev").send("pay", session_id="ev-5")
    driver.drain("ev-5")
    paused = _all(run.events(timeout=5))
    assert [e.type for e in paused] == ["run.start", "step.done", "tool.done", "approval.requested", "run.done"]
    requested = paused[3].data
    assert requested["tool_name"] == "pay" and requested["args"] == {"amount": 5} and requested["kind"] == "tool"
    assert paused[-1].data["finish_reason"] == "awaiting-approval"
    assert paused[-1].data["approval_ids"] == [requested["approval_id"]]
    resumed = client.approvals.resolve(requested["approval_id"], approved=True)
    driver.drain("ev-5")
    rest = _all(resumed.events(timeout=5))
    assert [e.type for e in rest] == ["tool.done", "step.done", "run.done"]
    last = paused[-1].seq
    assert last is not None and rest[0].data["result"] == "paid 5" and rest[0].seq == last + 1


def test_failures_are_events_a_retry_and_a_parked_run(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(Agent(name="ev", model=MockModel(lambda messages: {"error": "boom", "retryable": False})))
    run = client.agent("ev").send("go", session_id="ev-6")
    driver.drain("ev-6")
    seen = _all(run.events(timeout=5))
    assert [e.type for e in seen] == ["run.start", "error", "run.done"]
    assert seen[1].data["retryable"] is False and seen[2].data["finish_reason"] == "error"

    flaky = iter([{"error": "try later", "retryable": True}])
    driver = make_driver(Agent(name="ev2", model=MockModel(lambda messages: next(flaky, "fine"))))
    run = client.agent("ev2").send("go", session_id="ev-7", check_agent=False)
    driver.drain("ev-7")
    seen = _all(run.events(timeout=5))
    assert [e.type for e in seen] == ["run.start", "provider.retry", "step.done", "run.done"]
    assert seen[1].data["failures"] == 1 and seen[1].data["delay_s"] > 0


def test_live_signals_reach_a_watching_reader_and_are_never_stored(
    make_driver: Callable[..., Driver], client: Client, redis_client: redis.Redis
) -> None:
    driver = make_driver(
        Agent(
            name="ev",
            model=MockModel([{"text": "let me look", **_calls(("lookup", {"key": "a"}))}, "the answer is one"]),
            tools=[lookup],
        )
    )
    stream = client.agent("ev").stream("look", session_id="ev-8", live=True, timeout=10)
    got: list[Event] = []
    reader = _in_thread(lambda: got.extend(stream))
    _watching(redis_client, "ev-8")
    driver.drain("ev-8")
    reader.join(10)
    types = [e.type for e in got]
    assert "text.delta" in types and "step.start" in types and "tool.start" in types
    text = "".join(e.data["text"] for e in got if e.type == "text.delta")
    assert text == "let me lookthe answer is one"
    assert all(e.seq is None for e in got if e.type in ("text.delta", "step.start", "tool.start"))
    durable = [e.seq for e in got if e.seq is not None]
    assert durable == list(range(len(durable))) and types[-1] == "run.done"
    stored = client.read_events("ev-8", -1)
    assert {e.type for e in stored} <= {"run.start", "step.done", "tool.done", "run.done"}


def test_abort_mid_batch_cancels_running_calls_starts_no_more_and_a_send_finishes_the_run(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    script = [_calls(*[("slow", {"key": k}) for k in "abc"]), "after the abort"]
    driver = make_driver(Agent(name="ev", model=MockModel(script), tools=[slow], tool_concurrency=1))
    run = client.agent("ev").send("work", session_id="ev-9")
    driver.step("ev-9")  # the model turn
    batch = _in_thread(lambda: driver.step())
    _wait_started(1)
    asked = time.monotonic()
    assert client.agent("ev").abort("ev-9") is True
    batch.join(10)
    took = time.monotonic() - asked
    assert driver.outcomes[-1] == Outcome.ABORTED
    assert started == ["a"] and finished == []  # b and c never started; a stopped on ctx.cancelled
    assert took < 0.5 + 1.0  # one renewal interval (0.5 s here) plus the tool's own reaction
    result = run.wait(timeout=5)
    assert result.finish_reason == "aborted"
    checkpoint = client.agent("ev").load("ev-9")
    assert checkpoint is not None and checkpoint.status == "in-progress" and checkpoint.aborted
    results = [m for m in checkpoint.messages if m.role == "tool"]
    assert [json.loads(m.content)["kind"] for m in results] == ["cancelled"] * 3
    assert [p.state for p in client.agent("ev").pending()] == ["aborted"]
    # The sweep leaves it alone; nothing moves it without a person.
    assert isinstance(client.store, PostgresCheckpointStore)
    assert "ev-9" not in [due.session_id for due in client.store.due_runs(0.0)]
    assert client.agent("ev").abort("ev-9") is False  # already stopped
    events = client.read_events("ev-9", -1)
    assert [e.type for e in events][-4:] == ["tool.error", "tool.error", "tool.error", "run.done"]
    assert events[-1].data["finish_reason"] == "aborted"
    _transcript_matches(events, checkpoint.messages)
    after = client.agent("ev").send("carry on", session_id="ev-9")
    driver.drain("ev-9")
    assert after.wait(timeout=5).finish_reason == "stop"


def test_abort_of_a_paused_run_withdraws_its_approvals(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(Agent(name="ev", model=MockModel([_calls(("pay", {"amount": 9})), "ok"]), tools=[pay]))
    client.agent("ev").send("pay", session_id="ev-10")
    driver.drain("ev-10")
    approval = client.approvals.list()[0]
    assert client.agent("ev").abort("ev-10") is True
    driver.drain("ev-10")
    assert client.approvals.list() == []
    with pytest.raises(errors.ApprovalOrphanedError):
        client.approvals.resolve(approval.approval_id, approved=True)
    checkpoint = client.agent("ev").load("ev-10")
    assert checkpoint is not None and checkpoint.finish_reason == "aborted" and checkpoint.approval_ids == []
    assert json.loads(checkpoint.messages[-1].content)["kind"] == "cancelled"
    resumed = client.agent("ev").resume("ev-10")
    assert resumed is not None
    driver.drain("ev-10")
    assert resumed.wait(timeout=5).finish_reason == "stop"


def test_abort_of_a_finished_run_does_nothing(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(Agent(name="ev", model=MockModel(["done"])))
    client.agent("ev").send("hi", session_id="ev-11")
    driver.drain("ev-11")
    assert client.agent("ev").abort("ev-11") is False
    with pytest.raises(errors.CheckpointNotFoundError):
        client.agent("ev").abort("ev-none")


def test_steer_mid_batch_keeps_unstarted_calls_from_starting_and_the_model_sees_the_message_next(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    asked: list[list[str]] = []

    def model(messages: list[Message]) -> Any:
        asked.append([str(m.content) for m in messages if m.role == "user"])
        if len(asked) == 1:
            return _calls(*[("slow", {"key": k}) for k in "abc"])
        return "redirected"

    driver = make_driver(Agent(name="ev", model=MockModel(model), tools=[slow], tool_concurrency=1))
    client.agent("ev").send("work", session_id="ev-12")
    driver.step("ev-12")
    batch = _in_thread(lambda: driver.step())
    _wait_started(1)
    steered = client.agent("ev").steer("ev-12", "stop that, do something else")
    batch.join(10)
    assert started == ["a"] and finished == ["a"]  # the running call finished; the others never started
    driver.drain("ev-12")
    result = steered.wait(timeout=5)
    assert result.finish_reason == "stop" and result.text == "redirected"
    assert asked[-1] == ["work", "stop that, do something else"]
    checkpoint = client.agent("ev").load("ev-12")
    assert checkpoint is not None
    results = [m for m in checkpoint.messages if m.role == "tool"]
    assert results[0].content == "a done"
    assert [json.loads(m.content)["error"] for m in results[1:]] == ["RunRedirected", "RunRedirected"]
    # The message comes after every result of the turn.
    user_at = max(i for i, m in enumerate(checkpoint.messages) if m.role == "user")
    assert all(i < user_at for i, m in enumerate(checkpoint.messages) if m.role == "tool")


def test_steer_of_a_paused_run_is_refused(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(Agent(name="ev", model=MockModel([_calls(("pay", {"amount": 9})), "ok"]), tools=[pay]))
    client.agent("ev").send("pay", session_id="ev-13")
    driver.drain("ev-13")
    with pytest.raises(errors.SessionAwaitingApprovalError):
        client.agent("ev").steer("ev-13", "never mind")


def test_events_go_with_their_run(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(Agent(name="ev", model=MockModel(["done"])))
    client.agent("ev").send("hi", session_id="ev-14")
    driver.drain("ev-14")
    assert client.read_events("ev-14", -1)
    client.agent("ev").delete("ev-14")
    assert client.read_events("ev-14", -1) == []


def test_an_async_reader_that_stops_early_leaves_no_thread_behind(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    import asyncio

    make_driver(Agent(name="ev", model=MockModel(["x"])))
    run = client.agent("ev").send("hi", session_id="ev-15")  # never stepped: the reader waits
    before = threading.active_count()

    async def read_then_leave() -> None:
        async def read() -> None:
            async for _ in run.events_async():
                pass

        task = asyncio.create_task(read())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    runner = _in_thread(lambda: asyncio.run(read_then_leave()))
    runner.join(5)
    assert not runner.is_alive(), "the reader's thread kept the event loop from closing"
    deadline = time.monotonic() + 3.0
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


def test_abort_of_a_parallel_batch_cancels_every_running_call(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    script = [_calls(*[("slow", {"key": k}) for k in "abcd"]), "after"]
    driver = make_driver(Agent(name="ev", model=MockModel(script), tools=[slow], tool_concurrency=3))
    run = client.agent("ev").send("work", session_id="ev-16")
    driver.step("ev-16")
    batch = _in_thread(lambda: driver.step())
    _wait_started(3)
    client.agent("ev").abort("ev-16")
    batch.join(10)
    assert driver.outcomes[-1] == Outcome.ABORTED
    assert sorted(started) == ["a", "b", "c"] and finished == []  # d never started; a-c stopped early
    assert run.wait(timeout=5).finish_reason == "aborted"
    checkpoint = client.agent("ev").load("ev-16")
    assert checkpoint is not None
    assert [json.loads(m.content)["kind"] for m in checkpoint.messages if m.role == "tool"] == ["cancelled"] * 4


def test_an_answer_cut_at_the_token_limit_finishes_with_length(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(Agent(name="ev", model=MockModel([{"text": "the answer is cut", "finish_reason": "length"}])))
    run = client.agent("ev").send("tell me everything", session_id="ev-17")
    driver.drain("ev-17")
    assert run.wait(timeout=5).finish_reason == "length"
    assert client.read_events("ev-17", -1)[-1].data["finish_reason"] == "length"
