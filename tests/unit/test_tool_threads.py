"""The tool threads of a process: a call that cannot start in time is cancelled and never runs, a hung call gives
its place up, a call made from a thread of the set never waits on the set."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from worker.tool_threads import ToolThreads

#: Every wait in these tests ends by this deadline (seconds), whatever happens.
DEADLINE = 10.0


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """An event the blocking calls wait on; set at teardown so no thread outlives the test."""
    opened = threading.Event()
    yield opened
    opened.set()


def _blocker(gate: threading.Event, entered: threading.Event) -> str:
    entered.set()
    gate.wait(DEADLINE)
    return "unblocked"


def test_a_call_that_finds_no_free_thread_in_time_is_cancelled_and_never_runs(gate: threading.Event) -> None:
    threads = ToolThreads(size=1)
    entered = threading.Event()
    busy = threads.submit(_blocker, gate, entered)
    assert entered.wait(DEADLINE)
    ran: list[str] = []

    queued = threads.submit(ran.append, "late")
    assert threads.wait(queued, 0.05) == "not-started"
    assert queued.cancelled()

    gate.set()
    assert busy.result(DEADLINE) == "unblocked"
    after = threads.submit(ran.append, "next")  # in order: the cancelled call would have run before this one
    assert threads.wait(after, DEADLINE) == "done"
    assert ran == ["next"] and threads.hung == 0


def test_a_call_past_its_timeout_is_given_up_on_and_its_thread_no_longer_holds_a_place(gate: threading.Event) -> None:
    threads = ToolThreads(size=1)
    entered = threading.Event()
    stuck = threads.submit(_blocker, gate, entered)
    assert threads.wait(stuck, 0.05) == "overdue"
    assert entered.is_set() and threads.hung == 1

    answered = threads.submit(lambda: "answered")  # the only place was the hung call's: a new thread takes it
    assert threads.wait(answered, DEADLINE) == "done" and answered.result() == "answered"

    gate.set()
    assert stuck.result(DEADLINE) == "unblocked"
    assert threads.hung == 0  # counted off before its result was handed over


def test_a_call_made_from_a_thread_of_the_set_starts_at_once_even_when_the_set_is_full() -> None:
    threads = ToolThreads(size=1)

    def outer() -> str:
        inner = threads.submit(lambda: "inner")
        assert threads.wait(inner, DEADLINE) == "done"
        return f"outer with {inner.result()}"

    running = threads.submit(outer)
    assert threads.wait(running, DEADLINE) == "done" and running.result() == "outer with inner"


def test_a_call_submitted_at_once_never_waits_for_a_busy_set(gate: threading.Event) -> None:
    threads = ToolThreads(size=1)
    entered = threading.Event()
    busy = threads.submit(_blocker, gate, entered)  # a call of another step that does not return
    assert entered.wait(DEADLINE)
    batch_call = threads.submit(lambda: "ran", at_once=True)
    assert threads.wait(batch_call, DEADLINE) == "done" and batch_call.result() == "ran"
    assert not busy.done()


def test_a_call_that_raises_hands_its_error_to_the_waiter() -> None:
    threads = ToolThreads(size=2)

    def fail() -> None:
        raise LookupError("no such order")

    failing = threads.submit(fail)
    assert threads.wait(failing, DEADLINE) == "done"
    with pytest.raises(LookupError):
        failing.result()


def test_cancel_waiting_drops_the_calls_that_have_not_started(gate: threading.Event) -> None:
    threads = ToolThreads(size=1)
    entered = threading.Event()
    busy = threads.submit(_blocker, gate, entered)
    assert entered.wait(DEADLINE)
    ran: list[int] = []
    waiting = [threads.submit(ran.append, n) for n in range(3)]

    threads.cancel_waiting([busy, *waiting])

    assert all(future.cancelled() for future in waiting) and not busy.cancelled()
    gate.set()
    assert busy.result(DEADLINE) == "unblocked"
    last = threads.submit(ran.append, 99)
    assert threads.wait(last, DEADLINE) == "done" and ran == [99]
