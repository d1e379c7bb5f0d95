"""Contract checks of what a run keeps and shows: history, failures and parking, progress, listings."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from store import errors
from store.records import LastError, PendingRun, Progress
from tests.fakes.store_contract.subject import (
    AGENT,
    StoreFactory,
    claimed_run,
    new_run,
    save_next,
    user_message,
)

# -- history -------------------------------------------------------------------------------------


def check_history_is_newest_first_and_keeps_a_ring(make: StoreFactory) -> None:
    store = make(3).store
    checkpoint = new_run(store, "ct-ring")
    for step in range(1, 6):
        checkpoint = save_next(
            store,
            checkpoint,
            step=step,
            messages=[user_message(f"m{step}")],
            status="finished" if step == 5 else "in-progress",
        )
    entries = store.history("ct-ring")
    assert [e.seq for e in entries] == [5, 4, 3]
    assert [e.step for e in entries] == [5, 4, 3]
    assert [e.status for e in entries] == ["finished", "in-progress", "in-progress"]
    assert [e.checkpoint.messages[0].content for e in entries] == ["m5", "m4", "m3"]
    assert all(e.checkpoint.session_id == "ct-ring" and e.checkpoint.agent == AGENT for e in entries)
    assert all(e.saved_at.tzinfo is not None and e.checkpoint.seq == e.seq for e in entries)
    assert entries[0].saved_at >= entries[-1].saved_at
    assert [e.seq for e in store.history("ct-ring", limit=2)] == [5, 4]
    assert store.history("ct-never-saved") == []


def check_history_rebuilds_every_kept_state_of_a_long_run(make: StoreFactory) -> None:
    store = make(20).store
    checkpoint = new_run(store, "ct-long")
    transcripts: dict[int, list[str]] = {}
    texts: list[str] = []
    for step in range(1, 41):
        # The transcript grows at its tail, except once when it is rewritten from the middle (a patch).
        texts = [*texts[:3], "rewritten"] if step == 25 else [*texts, f"m{step}"]
        checkpoint = save_next(store, checkpoint, step=step, messages=[user_message(t) for t in texts])
        transcripts[checkpoint.seq] = list(texts)
    entries = store.history("ct-long")
    assert [e.seq for e in entries] == list(range(40, 20, -1))
    for entry in entries:
        assert [m.content for m in entry.checkpoint.messages] == transcripts[entry.seq], f"seq {entry.seq}"
    assert [e.seq for e in store.history("ct-long", limit=3)] == [40, 39, 38]


def check_history_limit_zero_keeps_no_history(make: StoreFactory) -> None:
    store = make(0).store
    checkpoint = new_run(store, "ct-no-ring")
    save_next(store, checkpoint, step=1)
    assert store.history("ct-no-ring") == []


# -- failures and parking ------------------------------------------------------------------------


def check_record_failure_is_fenced(make: StoreFactory) -> None:
    store = make(50).store
    first = new_run(store, "ct-fail")
    claimed_run(store, "ct-fail", 2)
    error = LastError(code="LOUSHO_PROVIDER_REQUEST_FAILED", message="503", retryable=True)
    assert store.record_failure("ct-fail", first.fence, error) is None
    loaded = store.load("ct-fail")
    assert loaded is not None and loaded.last_error is None
    assert store.record_failure("ct-fail", 2, error) == 2
    loaded = store.load("ct-fail")
    assert loaded is not None and loaded.last_error == error and loaded.attempts == 2


def check_reset_attempts_clears_a_parked_run_only_while_in_progress(make: StoreFactory) -> None:
    store = make(50).store
    parked = new_run(store, "ct-parked")
    parked = save_next(store, parked, step=1)
    claimed_run(store, "ct-parked", 2)
    store.record_failure("ct-parked", 2, LastError(code="X", retryable=False))
    assert store.reset_attempts("ct-parked") == 1
    loaded = store.load("ct-parked")
    assert loaded is not None and loaded.attempts == 0 and loaded.last_error is None

    done = new_run(store, "ct-done")
    save_next(store, done, status="finished", inbox_cursor=1)
    assert store.reset_attempts("ct-done") is None
    assert store.reset_attempts("ct-nobody") is None


def check_reset_attempts_moves_a_waiting_run_once_no_child_can_move(make: StoreFactory) -> None:
    store = make(50).store
    lead = new_run(store, "ct-wait")
    child, gone = "ct-wait.task-00000000000000c1", "ct-wait.task-00000000000000c2"
    assert store.start_children("ct-wait", AGENT, [(child, AGENT, "a"), (gone, AGENT, "b")], fence=lead.fence) == []
    waiting = save_next(store, lead, inbox_cursor=1, waiting=True, delegated={"call-1": child, "call-2": gone})
    assert store.reset_attempts("ct-wait") is None  # both children can still move
    store.delete(gone)
    assert store.reset_attempts("ct-wait") is None  # one still can
    settled = claimed_run(store, child, 5)
    save_next(store, settled, status="finished", finish_reason="stop", inbox_cursor=1)

    assert store.reset_attempts("ct-wait") == waiting.seq
    loaded = store.load("ct-wait")
    assert loaded is not None and loaded.waiting  # its step records what the children came to


def check_reset_attempts_with_limits_writes_them_into_the_run(make: StoreFactory) -> None:
    store = make(50).store
    parked = new_run(store, "ct-limits")
    parked = save_next(store, parked, step=1)
    claimed_run(store, "ct-limits", 2)
    store.record_failure("ct-limits", 2, LastError(code="X", retryable=False))
    limits = {"max_cost": 2.5, "max_output_tokens": 20000}

    assert store.reset_attempts("ct-limits", limits) == 1
    loaded = store.load("ct-limits")
    assert loaded is not None and loaded.limits == limits and loaded.last_error is None

    # A reset without limits keeps those given before; a run with nothing to do takes none.
    assert store.reset_attempts("ct-limits") == 1
    loaded = store.load("ct-limits")
    assert loaded is not None and loaded.limits == limits
    done = new_run(store, "ct-limits-done")
    save_next(store, done, status="finished", inbox_cursor=1)
    assert store.reset_attempts("ct-limits-done", limits) is None
    loaded = store.load("ct-limits-done")
    assert loaded is not None and loaded.limits is None


def check_a_checkpoint_with_limits_and_a_run_config_reads_back(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = new_run(store, "ct-format-3")
    run_config = {"model": {"provider": "mock", "model_id": "mock-b"}, "input_number": 1}
    saved = save_next(
        store,
        checkpoint,
        step=1,
        messages=[user_message("hello")],
        limits={"max_input_tokens": 9},
        run_config=run_config,
        clock_spent_s=1.5,
    )

    loaded = store.load("ct-format-3")
    assert loaded is not None
    assert (loaded.limits, loaded.run_config, loaded.clock_spent_s) == ({"max_input_tokens": 9}, run_config, 1.5)
    assert [m.content for m in loaded.messages] == ["hello"]
    (entry,) = store.history("ct-format-3")
    assert (entry.checkpoint.limits, entry.checkpoint.run_config) == (saved.limits, saved.run_config)
    # The next holder claims and saves it like any other run.
    taken = claimed_run(store, "ct-format-3", saved.fence + 1)
    assert taken.limits == {"max_input_tokens": 9}
    save_next(store, taken, step=2)


def check_retry_later_is_fenced_and_sets_when_to_try_again(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    checkpoint = new_run(store, "ct-retry")
    error = LastError(code="LOUSHO_PROVIDER_REQUEST_FAILED", message="503", retryable=True)
    assert store.retry_later("ct-retry", checkpoint.fence + 1, error, 5.0) is None
    assert store.retry_later("ct-retry", checkpoint.fence, error, 5.0) == 0
    first = store.load("ct-retry")
    assert first is not None and (first.last_error, first.attempts, first.failures) == (error, 0, 1)
    assert first.retry_since is not None and first.next_attempt_at == first.retry_since + timedelta(seconds=5)
    subject.tick()
    assert store.retry_later("ct-retry", checkpoint.fence, error, 5.0) == 0
    second = store.load("ct-retry")
    assert second is not None and (second.failures, second.retry_since) == (2, first.retry_since)
    assert [r for r in store.due_runs(0) if r.session_id == "ct-retry"] == []  # its retry time is ahead
    (listed,) = [p for p in store.pending(AGENT) if p.session_id == "ct-retry"]
    assert (listed.state, listed.next_attempt_at) == ("retrying", second.next_attempt_at)


def check_a_due_retry_is_listed_until_the_sweep_sent_it(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = new_run(store, "ct-due")
    assert store.retry_later("ct-due", checkpoint.fence, LastError(code="X", retryable=True), 0.0) == 0
    due = [r for r in store.due_runs(3600) if r.session_id == "ct-due"]
    assert [(r.seq, r.agent, r.retrying) for r in due] == [(0, AGENT, True)]
    store.mark_swept(["ct-due"])
    assert [r for r in store.due_runs(3600) if r.session_id == "ct-due"] == []


# -- progress and listing --------------------------------------------------------------------------


def check_progress_shows_status_cursor_and_error_without_the_transcript(make: StoreFactory) -> None:
    store = make(50).store
    assert store.progress("ct-progress") is None
    checkpoint = new_run(store, "ct-progress")
    assert store.progress("ct-progress") == Progress(status="in-progress", inbox_cursor=0, inbox_head=1, agent=AGENT)
    error = LastError(code="X", message="boom", retryable=True)
    store.record_failure("ct-progress", checkpoint.fence, error)
    assert store.progress("ct-progress") == Progress(
        status="in-progress", inbox_cursor=0, inbox_head=1, last_error=error, agent=AGENT
    )
    save_next(store, checkpoint, status="finished", inbox_cursor=1)
    assert store.progress("ct-progress") == Progress(status="finished", inbox_cursor=1, inbox_head=1, agent=AGENT)
    # The latest input's number: a handle on the run waits for it (``Client.run``).
    store.append_input("ct-progress", AGENT, [user_message("more")])
    assert store.progress("ct-progress") == Progress(status="finished", inbox_cursor=1, inbox_head=2, agent=AGENT)


def check_list_filters_and_orders_by_creation(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    store.append_input("ct-list-z", AGENT, [user_message("first created")])
    subject.tick()
    store.append_input("ct-list-a", AGENT, [user_message("second created")])
    store.append_input("ct-list-other", "other-agent", [user_message("another agent")])
    finished = claimed_run(store, "ct-list-a", 1)
    save_next(store, finished, status="finished", inbox_cursor=1)

    ours = {"ct-list-z", "ct-list-a", "ct-list-other"}

    def listed(**kwargs: Any) -> list[str]:
        return [c.session_id for c in store.list(**kwargs) if c.session_id in ours]

    assert listed() == ["ct-list-z", "ct-list-a", "ct-list-other"]
    assert listed(statuses=["in-progress"]) == ["ct-list-z", "ct-list-other"]
    assert listed(statuses=["finished"], agent=AGENT) == ["ct-list-a"]
    assert listed(agent="other-agent") == ["ct-list-other"]
    assert listed(statuses=[]) == []
    assert len(store.list(limit=1)) == 1
    # The newest first: what a list of the latest runs keeps when there are more than its limit.
    assert listed(newest=True) == ["ct-list-other", "ct-list-a", "ct-list-z"]
    assert [c.session_id for c in store.list(agent=AGENT, newest=True, limit=1)] == ["ct-list-a"]


def check_an_unreadable_checkpoint_is_listed_as_corrupt(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    store.append_input("ct-corrupt", AGENT, [user_message("hi")])
    subject.corrupt("ct-corrupt")
    (entry,) = [c for c in store.list() if c.session_id == "ct-corrupt"]
    assert isinstance(entry, PendingRun)
    assert entry.last_error is not None and entry.last_error.code == "LOUSHO_CHECKPOINT_CORRUPT"
    assert entry.last_error.retryable is False and entry.agent == AGENT
    with pytest.raises(errors.CheckpointCorruptError):
        store.load("ct-corrupt")


def check_stale_runs_are_those_that_should_be_moving(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    moving = new_run(store, "ct-stale-moving")
    save_next(store, moving, step=1)
    subject.tick()
    retrying = new_run(store, "ct-stale-retrying")
    store.record_failure("ct-stale-retrying", retrying.fence, LastError(code="X", retryable=True))
    parked = new_run(store, "ct-stale-parked")
    store.record_failure("ct-stale-parked", parked.fence, LastError(code="X", retryable=False))
    done = new_run(store, "ct-stale-done")
    save_next(store, done, status="finished", inbox_cursor=1)
    waiting = new_run(store, "ct-stale-waiting")
    save_next(store, waiting, status="finished", inbox_cursor=1)
    store.append_input("ct-stale-waiting", AGENT, [user_message("one more")])
    subject.tick()

    ours = {"ct-stale-moving", "ct-stale-retrying", "ct-stale-parked", "ct-stale-done", "ct-stale-waiting"}
    stale = [(sid, seq) for sid, seq in store.stale_runs(0) if sid in ours]
    assert stale[0] == ("ct-stale-moving", 1)  # oldest update first
    assert sorted(stale[1:]) == [("ct-stale-retrying", 0), ("ct-stale-waiting", 1)]
    assert [sid for sid, _ in store.stale_runs(3600) if sid in ours] == []
    assert len(store.stale_runs(0, limit=1)) == 1


CHECKS: tuple[Callable[[StoreFactory], None], ...] = (
    check_history_is_newest_first_and_keeps_a_ring,
    check_history_rebuilds_every_kept_state_of_a_long_run,
    check_history_limit_zero_keeps_no_history,
    check_record_failure_is_fenced,
    check_reset_attempts_clears_a_parked_run_only_while_in_progress,
    check_reset_attempts_moves_a_waiting_run_once_no_child_can_move,
    check_reset_attempts_with_limits_writes_them_into_the_run,
    check_a_checkpoint_with_limits_and_a_run_config_reads_back,
    check_retry_later_is_fenced_and_sets_when_to_try_again,
    check_a_due_retry_is_listed_until_the_sweep_sent_it,
    check_progress_shows_status_cursor_and_error_without_the_transcript,
    check_list_filters_and_orders_by_creation,
    check_an_unreadable_checkpoint_is_listed_as_corrupt,
    check_stale_runs_are_those_that_should_be_moving,
)
