"""overlap="skip" on the real database: which states of the previous run hold back the next tick.

The previous run is active (the next tick is claimed without a run) while it waits on an approval,
or is in progress or holds unread input without being parked. A parked run (its last error is not
retryable) waits for a human, possibly forever: it must not stop the schedule.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text

from producer.schedules import Schedules
from store import records
from store.checkpoints import PostgresCheckpointStore
from store.schedules import PostgresScheduleStore
from worker.schedules import sweep

pytestmark = pytest.mark.integration

PARKED = {"code": "LOUSHO_PROVIDER_ERROR", "message": "400: context length exceeded", "retryable": False}
RETRYING = {"code": "LOUSHO_PROVIDER_ERROR", "message": "503: overloaded", "retryable": True}

#: case -> (finish the first run, then send it a follow-up, then force status, last_error; active?)
CASES: dict[str, tuple[bool, bool, str | None, dict[str, Any] | None, bool]] = {
    "parked-in-progress": (False, False, None, PARKED, False),
    "parked-after-a-follow-up": (True, True, None, PARKED, False),
    "finished": (True, False, None, None, False),
    "in-progress": (False, False, None, None, True),
    "retrying-in-progress": (False, False, None, RETRYING, True),
    "follow-up-queued": (True, True, None, None, True),
    "follow-up-retrying": (True, True, None, RETRYING, True),
    "awaiting-approval": (False, False, "awaiting-approval", None, True),
}


def _wait_for_tick(store: PostgresScheduleStore, name: str) -> None:
    """Sleep until the schedule's next tick has passed on the database's clock."""
    due = store.get(name).next_fire_at
    with store.engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar_one()
    time.sleep(max(0.0, (due - now).total_seconds()) + 0.05)


@pytest.mark.parametrize("case", list(CASES))
def test_overlap_skip_holds_the_next_tick_only_while_the_previous_run_is_active(
    case: str,
    schedules: Schedules,
    schedule_store: PostgresScheduleStore,
    store: PostgresCheckpointStore,
    finish: Callable[[str], object],
) -> None:
    finished, follow_up, status, last_error, active = CASES[case]
    schedules.create("slow", "reporter", "Send the report", every=1, overlap="skip")
    _wait_for_tick(schedule_store, "slow")
    (previous,) = sweep(schedule_store).session_ids
    if finished:
        finish(previous)
    if follow_up:
        store.append_input(previous, "reporter", [records.Message(role="user", content="And the totals?")])
    with schedule_store.engine.begin() as conn:  # the state a failed or gated turn leaves behind
        conn.execute(
            text(
                "UPDATE runs SET status = COALESCE(:status, status), last_error = CAST(:error AS jsonb)"
                " WHERE session_id = :sid"
            ),
            {"status": status, "error": None if last_error is None else json.dumps(last_error), "sid": previous},
        )

    _wait_for_tick(schedule_store, "slow")
    later = sweep(schedule_store)

    print(f"\n{case}: previous run active={active}; next sweep fired {len(later.fired)}, skipped {later.skipped}")
    if active:
        assert later.fired == [] and later.skipped >= 1
    else:
        assert len(later.fired) == 1 and later.fired[0][2] != previous
        assert schedule_store.get("slow").last_session_id == later.fired[0][2]
