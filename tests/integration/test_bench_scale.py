"""The stored-runs generator of ``bench.scale`` (``bench.stored_runs.fill_mix``), at a small size on the real database.

It must keep giving every state its share, the sub-agent runs, history, events and approvals it promises, and the
same fixed work to the bounded operations (runs due for the sweep, lost wake-ups, one retention cohort), or the
benchmark's figures silently stop meaning anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from psycopg.rows import TupleRow

from bench.stored_runs import Mix, fill_mix, touch_moving
from store import listing, retention
from store.checkpoints import PostgresCheckpointStore
from tests.support import services

RUNS = 200


@pytest.fixture
def conn() -> Iterator[psycopg.Connection[TupleRow]]:
    with psycopg.connect(services.test_database_url(), autocommit=True) as connection:
        yield connection


def _count(conn: psycopg.Connection[TupleRow], sql: str) -> int:
    row = conn.execute(sql).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def mix(conn: psycopg.Connection[TupleRow]) -> Mix:
    return fill_mix(conn, RUNS, crashed=3, retries_due=2, lost_wakeups=1, cohorts=2, cohort_runs=10)


def test_every_state_holds_its_share_of_the_runs_of_their_own(conn: psycopg.Connection[TupleRow], mix: Mix) -> None:
    rows = conn.execute(
        f"SELECT state, count(*) FROM (SELECT {listing.STATE} AS state FROM runs"
        " WHERE parent_id IS NULL AND session_id LIKE 'run-%') s GROUP BY state"
    ).fetchall()

    assert {state: n for state, n in rows} == mix.states
    assert sum(mix.states.values()) == RUNS
    assert mix.states["finished"] == 160 and mix.states["waiting"] == 4 and mix.states["awaiting-approval"] == 8


def test_sub_agent_runs_history_events_and_approvals_are_there(conn: psycopg.Connection[TupleRow], mix: Mix) -> None:
    # Two under one finished run in ten (16), under each waiting lead (4) and one cohort run in ten (2).
    assert mix.children == 2 * (16 + 4 + 2)
    assert _count(conn, "SELECT count(*) FROM runs WHERE parent_id IS NOT NULL") == mix.children
    assert _count(conn, "SELECT count(*) FROM runs") == mix.total_runs == RUNS + 20 + mix.children
    for table, per_run in (
        ("checkpoint_history", mix.history),
        ("run_messages", mix.messages),
        ("run_events", mix.events),
    ):
        assert _count(conn, f"SELECT count(*) FROM {table}") == mix.total_runs * per_run
    # Each paused run's own, and the approval of the child each paused lead waits on; one finished run in ten's.
    assert mix.paused_leads == 1
    pending = _count(conn, "SELECT count(*) FROM approvals WHERE status = 'pending'")
    assert pending == mix.states["awaiting-approval"] + mix.paused_leads
    assert _count(conn, "SELECT count(*) FROM approvals WHERE status = 'approved'") == 16


def test_the_bounded_operations_find_the_fixed_work(
    conn: psycopg.Connection[TupleRow], mix: Mix, store: PostgresCheckpointStore
) -> None:
    touch_moving(conn)

    due = store.due_runs(60.0)
    leads = store.waiting_leads(60.0)
    cohort = retention.count_due(store.engine, timedelta(days=400, hours=-12))

    assert sorted(run.retrying for run in due) == [False] * mix.crashed + [True] * mix.retries_due
    assert len(leads) == mix.lost_wakeups
    # The oldest cohort: its runs, and two sub-agent runs under one in ten.
    assert cohort.runs == mix.cohort_runs + 2
