"""A decision racing a step of its paused run, on real Postgres: the step's save that leaves the run paused waits
for the decision's transaction (it holds the run's row) and must then keep the run in progress, since the save
re-reads the row it updates once the lock is free."""

from __future__ import annotations

import threading
from datetime import datetime

import psycopg

from store.checkpoints import PostgresCheckpointStore
from store.records import StepWrite
from tests.fakes.store_contract.approvals import _paused
from tests.fakes.store_contract.subject import claimed_run
from tests.support import services

LOCK_WAIT_S = 10.0


def test_a_paused_save_waiting_on_the_decisions_lock_keeps_the_run_in_progress(store: PostgresCheckpointStore) -> None:
    _paused(store, "race-decide", calls=1)
    step = claimed_run(store, "race-decide", 2)  # a step of the paused run begins
    saved: list[datetime | None] = []
    with psycopg.connect(services.test_database_url()) as decision:  # the last decision, not committed yet
        decision.execute(
            "UPDATE approvals SET status = 'approved', decided_at = now() WHERE session_id = 'race-decide'"
        )
        decision.execute("UPDATE runs SET status = 'in-progress', attempts = 0 WHERE session_id = 'race-decide'")
        write = StepWrite(checkpoint=step.model_copy(update={"seq": step.seq + 1}), paused_before=True)
        saving = threading.Thread(target=lambda: saved.append(store.record_step(write)))
        saving.start()
        services.wait_for_lock_waiter(store.engine, "the step's save to wait for the decision's lock")
        decision.commit()
    saving.join(LOCK_WAIT_S)
    assert not saving.is_alive(), "the step's save did not end"
    assert saved and saved[0] is not None, "the step's save was refused"
    loaded = store.load("race-decide")
    assert loaded is not None and loaded.status == "in-progress", "the step's save undid the decision"
