"""``@tool(timeout=…)``: a call that runs too long gets a ``timeout`` result and the run goes on; a call that never
started is never recorded as timed out, and hung calls never leave a batch waiting on a full pool."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from producer.client import Client
from store import errors
from store.records import Message
from tests.support.driver import Driver
from worker import Agent, HookContext, ToolContext, tool, tool_threads
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
    make_driver: Callable[..., Driver], client: Client
) -> None:
    told.clear()
    driver = make_driver(
        Agent(
            name="slowpoke",
            model=MockModel(
                [
                    {"tool_calls": [{"name": "stuck", "args": {"key": "a"}}, {"name": "quick", "args": {"key": "b"}}]},
                    "gave up on a",
                ]
            ),
            tools=[stuck, quick],
            tool_concurrency=1,
        )
    )
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


#: Calls of ``hang`` that started, and the ones that ended; ``released`` lets every hung call end.
hung_started: list[str] = []
hung_ended: list[str] = []
released = threading.Event()


@tool(timeout=0.05)
def hang(key: str, ctx: ToolContext) -> str:
    """Call a service that never answers (and does not listen to ``ctx.cancelled``)."""
    hung_started.append(ctx.tool_call_id)
    released.wait(30)
    hung_ended.append(ctx.tool_call_id)
    return f"{key} answered at last"


@tool
def plain(key: str) -> str:
    """Answer at once, no timeout."""
    return f"{key} plain"


class _WhenRecorded:
    """A ``post_tool_call`` hook noting, as each result is recorded, its kind and whether its call had started."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[str, bool]] = {}

    def post_tool_call(self, ctx: HookContext, result: Message) -> None:
        kind = json.loads(str(result.content))["kind"] if result.is_error else "ok"
        self.seen[str(ctx.tool_call_id)] = (kind, ctx.tool_call_id in hung_started)


@pytest.fixture
def hung_process(make_driver: Callable[..., Driver], client: Client) -> Iterator[dict[str, tuple[str, bool]]]:
    """This process after a run whose 64 calls all hung past their timeout; the hung calls end at teardown.

    Yields, per call, the kind of result it was recorded with and whether it had started then.
    """
    hung_started.clear()
    hung_ended.clear()
    released.clear()
    recorded = _WhenRecorded()
    calls = [{"name": "hang", "args": {"key": f"k{n}"}} for n in range(64)]
    driver = make_driver(
        Agent(
            name="hanger",
            model=MockModel([{"tool_calls": calls}, "all given up"]),
            tools=[hang],
            tool_concurrency=16,
            hooks=[recorded],
        )
    )
    run = client.agent("hanger").send("call them all", session_id="hung-1")
    try:
        driver.drain("hung-1")
        assert run.wait(timeout=10).finish_reason == "stop"
        yield recorded.seen
    finally:
        released.set()
        deadline = time.monotonic() + 10
        while len(hung_ended) < len(hung_started) and time.monotonic() < deadline:
            time.sleep(0.01)


def test_a_timed_call_recorded_as_timed_out_had_started_and_one_that_never_started_never_runs(
    hung_process: dict[str, tuple[str, bool]],
) -> None:
    assert len(hung_process) == 64
    kinds = [kind for kind, _ in hung_process.values()]
    print(f"\nof 64 hung calls: {kinds.count('timeout')} recorded timeout, {kinds.count('not-run')} not-run")
    assert set(kinds) <= {"timeout", "not-run"}
    unstarted = sorted(call for call, (kind, started) in hung_process.items() if kind == "timeout" and not started)
    assert not unstarted, f"{len(unstarted)} calls were recorded as timed out before they started"
    assert all(started for kind, started in hung_process.values() if kind == "timeout")
    not_run = {call for call, (kind, _) in hung_process.items() if kind == "not-run"}
    released.set()
    deadline = time.monotonic() + 10
    while len(hung_ended) < len(hung_started) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not not_run & set(hung_started)  # a call recorded not-run never executes, even once threads free up


def test_a_batch_never_waits_on_threads_held_by_hung_calls(
    hung_process: dict[str, tuple[str, bool]], make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(
        Agent(
            name="plainer",
            model=MockModel(
                [
                    {"tool_calls": [{"name": "plain", "args": {"key": "a"}}, {"name": "plain", "args": {"key": "b"}}]},
                    "both answered",
                ]
            ),
            tools=[plain],
            tool_concurrency=2,
        )
    )
    client.agent("plainer").send("two quick ones", session_id="after-hung", check_agent=False)
    drained = threading.Thread(target=driver.drain, args=("after-hung",), daemon=True)
    drained.start()
    drained.join(timeout=10)
    stuck = drained.is_alive()
    released.set()  # frees the old pool so a stuck drain ends too
    drained.join(timeout=10)
    assert not stuck, "the batch waited on a pool full of hung calls"
    done = client.agent("plainer").load("after-hung")
    assert done is not None and done.final_text == "both answered"


charged: list[str] = []


@tool(timeout=0.2)
def charge(order: str, ctx: ToolContext) -> str:
    """Charge an order."""
    charged.append(ctx.tool_call_id)
    return f"charged {order}"


def test_a_timed_call_that_finds_every_thread_busy_is_recorded_not_run_and_never_runs_later(
    make_driver: Callable[..., Driver], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    charged.clear()
    threads = tool_threads.ToolThreads(size=1)  # one thread, held by another step's call (a threads pool)
    monkeypatch.setattr(tool_threads, "_threads", (os.getpid(), threads))
    other_call = threading.Event()
    entered = threading.Event()

    def occupy() -> None:
        entered.set()
        other_call.wait(10)

    busy = threads.submit(occupy)
    assert entered.wait(10)
    driver = make_driver(
        Agent(
            name="cashier",
            model=MockModel([{"tool_calls": [{"name": "charge", "args": {"order": "o9"}}]}, "could not charge"]),
            tools=[charge],
            tool_concurrency=1,
        )
    )
    run = client.agent("cashier").send("charge o9", session_id="full-1")
    try:
        driver.drain("full-1")
        result = run.wait(timeout=5)
    finally:
        other_call.set()
    body = json.loads(str(next(m for m in result.messages if m.role == "tool").content))
    assert (body["kind"], body["error"]) == ("not-run", "ToolNotStarted")
    busy.result(10)
    after = threads.submit(charged.append, "sentinel")  # in order: the charge would have run before this
    assert threads.wait(after, 10) == "done"
    assert charged == ["sentinel"]
