"""Contract checks of a run's durable events and of abort requests: numbering, references, lifetime."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from store import errors
from store.records import Checkpoint, EventDraft, LastError, Message, StepWrite, ToolCall
from tests.fakes.store_contract.subject import AGENT, StoreFactory, new_run, user_message


def _evented(store: Any, checkpoint: Checkpoint, drafts: Sequence[EventDraft], **update: Any) -> Checkpoint:
    new = checkpoint.model_copy(update={"seq": checkpoint.seq + 1, **update})
    assert (
        store.record_step(
            StepWrite(checkpoint=new, events=tuple(drafts), drained_inbox=new.inbox_cursor != checkpoint.inbox_cursor)
        )
        is not None
    )
    return new


def check_a_save_numbers_its_events_after_the_runs_last_one(make: StoreFactory) -> None:
    store = make(50).store
    run = new_run(store, "ct-ev-a")
    turn = Message(role="assistant", content="calling", tool_calls=[ToolCall(id="c1", name="t", args={"x": 1})])
    first = _evented(
        store,
        run,
        [
            EventDraft(type="run.start", data={"input_number": 1}),
            EventDraft(type="step.done", data={"step": 1}, message=turn),
        ],
        messages=[user_message("hello"), turn],
        inbox_cursor=1,
        step=1,
    )
    result = Message(role="tool", tool_call_id="c1", name="t", content="done")
    _evented(
        store,
        first,
        [EventDraft(type="tool.done", data={"duration_ms": 2.5}, message=result)],
        messages=[*first.messages, result],
    )
    events = store.read_events("ct-ev-a", -1)
    assert [(e.seq, e.type) for e in events] == [(0, "run.start"), (1, "step.done"), (2, "tool.done")]
    assert events[1].data["text"] == "calling" and events[1].data["tool_calls"] == [
        {"id": "c1", "name": "t", "args": {"x": 1}}
    ]
    assert events[2].data == {"duration_ms": 2.5, "tool_call_id": "c1", "tool_name": "t", "result": "done"}
    assert all(e.run_id == "ct-ev-a" and e.at.tzinfo is not None for e in events)
    assert [e.seq for e in store.read_events("ct-ev-a", 0, limit=1)] == [1]
    assert store.latest_start("ct-ev-a") == 0 and store.input_start("ct-ev-a", 1) == 0
    assert store.input_start("ct-ev-a", 2) is None
    progress = store.progress("ct-ev-a")
    assert progress is not None and progress.events_next == 3


def check_input_start_is_the_run_start_that_merged_the_input(make: StoreFactory) -> None:
    store = make(50).store
    run = new_run(store, "ct-ev-f")
    first = _evented(
        store,
        run,
        [EventDraft(type="run.start", data={"input_number": 1}), EventDraft(type="run.done")],
        inbox_cursor=1,
        status="finished",
    )
    # Inputs 2 and 3 were sent before the next step, which merged both: one run.start, numbered by the last.
    for text in ("two", "three"):
        store.append_input("ct-ev-f", AGENT, [user_message(text)])
    _evented(
        store,
        first,
        [EventDraft(type="run.start", data={"input_number": 3}), EventDraft(type="run.done")],
        inbox_cursor=3,
        status="finished",
    )
    assert [(e.seq, e.type, e.data.get("input_number")) for e in store.read_events("ct-ev-f", -1)] == [
        (0, "run.start", 1),
        (1, "run.done", None),
        (2, "run.start", 3),
        (3, "run.done", None),
    ]
    starts = [store.input_start("ct-ev-f", n) for n in (1, 2, 3, 4)]
    assert starts == [0, 2, 2, None], f"input_start of inputs 1-4: {starts}"
    assert store.latest_start("ct-ev-f") == 2


def check_a_fenced_out_save_writes_no_events(make: StoreFactory) -> None:
    store = make(50).store
    run = new_run(store, "ct-ev-b")
    store.claim("ct-ev-b", 5, None)  # another holder
    stale = run.model_copy(update={"seq": run.seq + 1})
    assert store.record_step(StepWrite(checkpoint=stale, events=(EventDraft(type="error"),))) is None
    assert store.read_events("ct-ev-b", -1) == []


def check_failures_write_their_events_under_the_fence(make: StoreFactory) -> None:
    store = make(50).store
    run = new_run(store, "ct-ev-c")
    error = LastError(code="X", message="m", retryable=True)
    assert store.retry_later("ct-ev-c", run.fence, error, 1.0, [EventDraft(type="provider.retry")]) is not None
    assert (
        store.record_failure("ct-ev-c", run.fence, error, [EventDraft(type="error"), EventDraft(type="run.done")])
        is not None
    )
    assert store.record_failure("ct-ev-c", run.fence + 1, error, [EventDraft(type="error")]) is None
    assert [(e.seq, e.type) for e in store.read_events("ct-ev-c", -1)] == [
        (0, "provider.retry"),
        (1, "error"),
        (2, "run.done"),
    ]


def check_events_go_with_their_run(make: StoreFactory) -> None:
    store = make(50).store
    run = new_run(store, "ct-ev-d")
    _evented(store, run, [EventDraft(type="run.done")])
    store.delete("ct-ev-d")
    assert store.read_events("ct-ev-d", -1) == []
    again = new_run(store, "ct-ev-d")
    _evented(store, again, [EventDraft(type="run.start")])
    assert [e.seq for e in store.read_events("ct-ev-d", -1)] == [0]


def check_an_abort_request_waits_for_a_step_and_rests_the_run_until_a_person_moves_it(make: StoreFactory) -> None:
    store = make(50).store
    run = new_run(store, "ct-ev-e")
    assert store.request_abort("ct-ev-e") is True
    assert store.abort_requested("ct-ev-e") is True
    claim = store.claim("ct-ev-e", run.fence + 1, None)
    assert claim.checkpoint is not None and claim.abort_requested
    stopped = claim.checkpoint.model_copy(
        update={  # the queued input is kept in the transcript
            "seq": claim.checkpoint.seq + 1,
            "aborted": True,
            "finish_reason": "aborted",
            "inbox_cursor": 1,
            "messages": [user_message("hello")],
        }
    )
    assert store.record_step(StepWrite(checkpoint=stopped, settles_abort=True, drained_inbox=True)) is not None
    assert store.abort_requested("ct-ev-e") is False
    assert store.request_abort("ct-ev-e") is False  # already aborted
    loaded = store.load("ct-ev-e")
    assert loaded is not None and loaded.aborted and loaded.status == "in-progress"
    assert [p.state for p in store.pending() if p.session_id == "ct-ev-e"] == ["aborted"]
    assert "ct-ev-e" not in [r.session_id for r in store.due_runs(0.0)]
    assert store.reset_attempts("ct-ev-e") is not None  # a resume
    resumed = store.load("ct-ev-e")
    assert resumed is not None and not resumed.aborted
    with pytest.raises(errors.CheckpointNotFoundError):
        store.request_abort("ct-ev-unknown")


def check_a_finished_run_cannot_be_aborted(make: StoreFactory) -> None:
    store = make(50).store
    run = new_run(store, "ct-ev-f")
    _evented(store, run, [], status="finished", finish_reason="stop")
    assert store.request_abort("ct-ev-f") is False
    store.append_input("ct-ev-f", AGENT, [user_message("more")])
    assert store.request_abort("ct-ev-f") is False  # finished with input waiting: not stopped either


CHECKS: tuple[Callable[[StoreFactory], None], ...] = (
    check_a_save_numbers_its_events_after_the_runs_last_one,
    check_input_start_is_the_run_start_that_merged_the_input,
    check_a_fenced_out_save_writes_no_events,
    check_failures_write_their_events_under_the_fence,
    check_events_go_with_their_run,
    check_an_abort_request_waits_for_a_step_and_rests_the_run_until_a_person_moves_it,
    check_a_finished_run_cannot_be_aborted,
)
