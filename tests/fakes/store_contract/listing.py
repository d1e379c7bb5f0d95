"""Contract checks of the runs listing: newest first by creation, paged by cursor, filtered by the store."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest

from store import errors, interfaces
from store.records import LastError, RunsPage, Usage
from tests.fakes.store_contract.subject import AGENT, StoreFactory, claimed_run, new_run, save_next, user_message


def _ids(page: RunsPage) -> list[str]:
    return [run.session_id for run in page.items]


def _walk(store: interfaces.CheckpointStore, cursor: str | None, way: str, **filters: Any) -> list[list[str]]:
    """The pages from ``cursor`` on, following ``next_cursor`` (``way="next"``) or ``prev_cursor``."""
    pages: list[list[str]] = []
    for _ in range(20):
        page = store.list_runs(cursor=cursor, **filters)
        pages.append(_ids(page))
        cursor = page.next_cursor if way == "next" else page.prev_cursor
        if cursor is None:
            return pages
    raise AssertionError(f"the pages never ended: {pages}")


def check_list_runs_pages_newest_first_by_cursor(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    for n in range(7):
        store.append_input(f"ct-lr-{n}", AGENT, [user_message("hi")])
        subject.tick()

    first = store.list_runs(limit=3)
    assert _ids(first) == ["ct-lr-6", "ct-lr-5", "ct-lr-4"] and first.prev_cursor is None
    assert first.next_cursor is not None
    # A run created while pages are read comes before the first page; the pages after it do not move.
    store.append_input("ct-lr-late", AGENT, [user_message("hi")])
    assert _walk(store, first.next_cursor, "next", limit=3) == [["ct-lr-3", "ct-lr-2", "ct-lr-1"], ["ct-lr-0"]]
    last = store.list_runs(limit=3, cursor=store.list_runs(limit=3, cursor=first.next_cursor).next_cursor)
    assert _ids(last) == ["ct-lr-0"] and last.next_cursor is None and last.prev_cursor is not None
    # Back toward the newer runs: the same pages, each newest first, then the run created since.
    assert _walk(store, last.prev_cursor, "prev", limit=3) == [
        ["ct-lr-3", "ct-lr-2", "ct-lr-1"],
        ["ct-lr-6", "ct-lr-5", "ct-lr-4"],
        ["ct-lr-late"],
    ]
    assert _ids(store.list_runs(limit=500)) == ["ct-lr-late", *[f"ct-lr-{n}" for n in range(6, -1, -1)]]
    # A run deleted under a cursor: the pages go on from where it stood.
    page = store.list_runs(limit=2, cursor=first.next_cursor)
    store.delete("ct-lr-2")
    assert _ids(store.list_runs(limit=2, cursor=page.next_cursor)) == ["ct-lr-1", "ct-lr-0"]


def _in_state(store: interfaces.CheckpointStore, session_id: str, state: str) -> None:
    """A run standing in ``state`` (a ``ListedState``)."""
    checkpoint = new_run(store, session_id)
    if state == "finished":
        save_next(store, checkpoint, status="finished", finish_reason="stop", inbox_cursor=1)
    elif state == "awaiting-approval":
        save_next(store, checkpoint, status="awaiting-approval", inbox_cursor=1)
    elif state == "waiting":
        save_next(store, checkpoint, waiting=True, inbox_cursor=1)
    elif state in ("aborted", "budget-exceeded"):
        save_next(store, checkpoint, aborted=True, finish_reason=state, inbox_cursor=1)
    elif state in ("parked", "retrying"):
        store.record_failure(session_id, checkpoint.fence, LastError(code="X", retryable=state == "retrying"))


STATES = ("running", "finished", "awaiting-approval", "aborted", "budget-exceeded", "parked", "retrying", "waiting")


def check_list_runs_shows_where_each_run_stands_and_filters_in_the_store(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    for state in STATES:
        _in_state(store, f"ct-ls-{state}", state)
        subject.tick()
    store.append_input("ct-ls-Other", "other-agent", [user_message("hi")])

    everything = store.list_runs(limit=100).items
    assert {run.session_id: run.state for run in everything} == {
        **{f"ct-ls-{state}": state for state in STATES},
        "ct-ls-Other": "running",
    }
    assert all(run.agent == (AGENT if run.session_id != "ct-ls-Other" else "other-agent") for run in everything)
    assert all(run.created_at <= run.updated_at and run.parent_id is None for run in everything)
    paused = next(run for run in everything if run.session_id == "ct-ls-awaiting-approval")
    assert paused.status == "awaiting-approval"
    # ``paused``, the word of an earlier release, still filters (for one release).
    with pytest.warns(DeprecationWarning, match="awaiting-approval"):
        assert _ids(store.list_runs(states=["paused"])) == ["ct-ls-awaiting-approval"]

    assert _ids(store.list_runs(states=["aborted", "budget-exceeded"])) == ["ct-ls-budget-exceeded", "ct-ls-aborted"]
    assert _ids(store.list_runs(states=["running"], agents=[AGENT])) == ["ct-ls-running"]
    assert _ids(store.list_runs(agents=["other-agent"])) == ["ct-ls-Other"]
    assert _ids(store.list_runs(agents=[])) == [] and _ids(store.list_runs(states=[])) == []
    assert _ids(store.list_runs(id_contains="OTHER")) == ["ct-ls-Other"]
    assert _ids(store.list_runs(id_contains="r%ng")) == []  # searched as text, not as a pattern
    since = next(run.created_at for run in everything if run.session_id == "ct-ls-parked")
    assert _ids(store.list_runs(since=since)) == ["ct-ls-Other", "ct-ls-waiting", "ct-ls-retrying", "ct-ls-parked"]
    # Filters hold across pages.
    assert _walk(
        store, None, "next", limit=2, agents=[AGENT], states=["running", "parked", "retrying", "awaiting-approval"]
    ) == [["ct-ls-retrying", "ct-ls-parked"], ["ct-ls-awaiting-approval", "ct-ls-running"]]

    # A run that moves on shows where it stands now.
    claimed = claimed_run(store, "ct-ls-running", 9)
    save_next(store, claimed, status="finished", finish_reason="stop", inbox_cursor=1)
    assert [run.state for run in store.list_runs(id_contains="ct-ls-running").items] == ["finished"]
    # Input sent to a finished or stopped run gives it work again: running (in pending() too) until a step takes it.
    for session_id in ("ct-ls-finished", "ct-ls-aborted"):
        store.append_input(session_id, AGENT, [user_message("and then?")])
    assert {run.session_id: run.state for run in store.list_runs(states=["running"]).items} == {
        "ct-ls-finished": "running",
        "ct-ls-aborted": "running",
        "ct-ls-Other": "running",
    }
    assert {run.session_id: run.state for run in store.pending()} == {
        "ct-ls-finished": "running",
        "ct-ls-aborted": "running",
        "ct-ls-Other": "running",
        **{
            f"ct-ls-{state}": state
            for state in ("awaiting-approval", "budget-exceeded", "parked", "retrying", "waiting")
        },
    }


def check_list_runs_details_and_counts_by_state(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    for state in STATES:
        _in_state(store, f"ct-lc-{state}", state)
        subject.tick()
    claimed = claimed_run(store, "ct-lc-running", 7)
    save_next(store, claimed, step=3, usage=Usage(input_tokens=5, output_tokens=2, total_tokens=7))
    store.append_input("ct-lc-Other", "other-agent", [user_message("hi")])

    # Without details a page reads no document: step, usage and finish reason are left out.
    plain = {run.session_id: run for run in store.list_runs(limit=100).items}
    assert all(run.step is None and run.usage is None for run in plain.values())
    assert plain["ct-lc-parked"].last_error is not None and plain["ct-lc-parked"].last_error.code == "X"
    assert plain["ct-lc-retrying"].failures == 0 and plain["ct-lc-retrying"].state == "retrying"
    detailed = {run.session_id: run for run in store.list_runs(limit=100, details=True).items}
    assert detailed["ct-lc-running"].step == 3 and detailed["ct-lc-running"].usage == Usage(
        input_tokens=5, output_tokens=2, total_tokens=7
    )
    assert detailed["ct-lc-finished"].finish_reason == "stop"
    assert detailed["ct-lc-budget-exceeded"].finish_reason == "budget-exceeded"
    assert [run.session_id for run in store.list_runs(limit=3, details=True).items] == _ids(store.list_runs(limit=3))

    assert store.count_runs() == {**{state: 1 for state in STATES}, "running": 2}
    assert store.count_runs(agents=[AGENT]) == {state: 1 for state in STATES}
    assert store.count_runs(agents=["other-agent"]) == {"running": 1}
    since = plain["ct-lc-retrying"].created_at
    assert store.count_runs(since=since) == {"retrying": 1, "waiting": 1, "running": 1}
    with pytest.raises(errors.ConfigurationError):
        store.count_runs(since=datetime(2024, 1, 1))


def check_list_runs_refuses_what_it_cannot_use(make: StoreFactory) -> None:
    store = make(50).store
    store.append_input("ct-lx-1", AGENT, [user_message("hi")])
    refused: list[dict[str, Any]] = [
        {"cursor": "not-a-cursor"},
        {"cursor": ""},
        {"cursor": "W10"},
        {"limit": 0},
        {"limit": 501},
        {"states": ["awaiting-approval", "sleeping"]},
        {"since": datetime(2024, 1, 1)},
        {"id_contains": "x" * 201},
    ]
    for arguments in refused:
        with pytest.raises(errors.ConfigurationError):
            store.list_runs(**arguments)
    assert _ids(store.list_runs(limit=500)) == ["ct-lx-1"]


CHECKS: tuple[Callable[[StoreFactory], None], ...] = (
    check_list_runs_pages_newest_first_by_cursor,
    check_list_runs_shows_where_each_run_stands_and_filters_in_the_store,
    check_list_runs_details_and_counts_by_state,
    check_list_runs_refuses_what_it_cannot_use,
)
