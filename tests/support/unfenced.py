"""A deliberately broken build for the negative control (NC1): saves without the epoch predicate.

Loaded into worker processes through ``LOUSHO_AGENTS`` (next to ``tests.support.agents``) when a test wants a
worker whose fenced save is switched off: every save is rewritten onto the run's current fence and seq, so a
holder whose lease was taken over still writes. The checker must catch what that does; if it does not, the
checker can no longer see this class of bug and the test fails. Nothing outside the tests imports this module.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import text

from store import records
from store.checkpoints import PostgresCheckpointStore

ENV = "LOUSHO_TEST_UNFENCED"
_original = PostgresCheckpointStore.record_step


def _unfenced(self: PostgresCheckpointStore, write: records.StepWrite) -> Any:
    checkpoint = write.checkpoint
    with self.engine.connect() as conn:
        row = conn.execute(
            text("SELECT fence, seq FROM runs WHERE session_id = :sid"), {"sid": checkpoint.session_id}
        ).first()
    if row is not None and (row.fence, row.seq) != (checkpoint.fence, checkpoint.seq - 1):
        moved = checkpoint.model_copy(update={"fence": row.fence, "seq": row.seq + 1})
        write = write.model_copy(update={"checkpoint": moved, "first_new_message": None})
    return _original(self, write)


if os.environ.get(ENV):
    PostgresCheckpointStore.record_step = _unfenced  # type: ignore[method-assign]
