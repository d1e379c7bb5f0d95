"""``delete`` and ``approvals.resolve`` of the same run, at the same moment, from two connections.

Both take the run's row lock and its approvals' row locks; taken in opposite orders they deadlock
(Postgres aborts one with a deadlock error). They must take them in the same order.
"""

from __future__ import annotations

import threading

from store import errors
from store.approvals import PostgresApprovalStore
from store.checkpoints import PostgresCheckpointStore
from tests.support.driver import paused_row

ROUNDS = 40


def test_delete_and_resolve_racing_never_deadlock(store: PostgresCheckpointStore) -> None:
    approvals = PostgresApprovalStore(store.engine)
    storage_errors: list[str] = []
    outcomes: dict[str, int] = {"resolved": 0, "orphaned": 0, "deleted": 0}
    lock = threading.Lock()

    def resolve(approval_id: str, start: threading.Barrier) -> None:
        start.wait()
        try:
            approvals.resolve(approval_id, approved=True)
            outcome = "resolved"
        except (errors.ApprovalOrphanedError, errors.ApprovalNotFoundError):
            outcome = "orphaned"
        except errors.StorageError as exc:
            outcome = ""
            storage_errors.append(exc.message)
        with lock:
            if outcome:
                outcomes[outcome] += 1

    def delete(session_id: str, start: threading.Barrier) -> None:
        start.wait()
        try:
            store.delete(session_id)
        except errors.StorageError as exc:
            storage_errors.append(exc.message)
            return
        with lock:
            outcomes["deleted"] += 1

    for k in range(ROUNDS):
        session_id, approval_id = paused_row(store, f"race-{k}")
        start = threading.Barrier(2)
        threads = [
            threading.Thread(target=resolve, args=(approval_id, start)),
            threading.Thread(target=delete, args=(session_id, start)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    print(
        f"\n[lock order] {ROUNDS} races: {outcomes}, storage errors {len(storage_errors)} {sorted(set(storage_errors))}"
    )
    assert storage_errors == []
    assert outcomes["deleted"] == ROUNDS and outcomes["resolved"] + outcomes["orphaned"] == ROUNDS
