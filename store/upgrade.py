"""Step two of checkpoint format 2: runs still stored in format 1 are moved to format 2, beside live workers.

A format-1 run holds its whole transcript in its document. A worker of this release converts such a run at
its next save, so only runs that do not move again (finished, paused, parked) stay in format 1;
``upgrade_runs`` converts those, a page of run ids at a time. Each run is read, then converted by statements
guarded by what was read (seq, fence, transcript id, the document still in format 1), so a run a step
claimed or saved in between is skipped, never overwritten: that step's save converts it. A run whose
document cannot be read is counted and left as it is.

A conversion writes the rows first, then the document. The first statement holds the run's row lock while
it writes every message as a row stamped with the run's current seq and drops any other row of the id;
readers ignore rows while the document holds the transcript (format 1). The second sets the format-2
document (``store.runs.format_document``) and renews the run's ``transcript_id``, under the same guard.
Rows and document are not written by one statement because a claim that waits on the run's row lock reads
the row as the writer left it but the rows as they were when the claim began: it would find fewer rows
than the document counts (the worker parks such a run as corrupt). Written apart, a claim that waited on
the rows' statement still finds the format-1 document, and one that waits on the document's began after the
rows were in, unless it stalled between its start and its lock for longer than a round trip.

History entries are left as they are: format-1 entries hold their own transcripts. Only a run that already
has message rows (left by a run stored in format 2 before) first gives its format-2 entries their
transcripts, as a save that rewrites rows does, since their rows are rewritten.

Run it once no worker of the previous release is left: such a worker writes format 1 again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy import Engine, text
from sqlalchemy.engine import Connection, Row

from store import errors, history, payloads, runs, transcripts
from store.database import Transaction

__all__ = ["NAMED_UNREADABLE", "UpgradeReport", "upgrade_runs"]

#: Unreadable runs a report names at most (it counts every one).
NAMED_UNREADABLE = 100

Outcome = Literal["converted", "skipped", "unreadable"]

_PAGE = text(
    "SELECT session_id FROM runs WHERE jsonb_exists(document, 'messages') AND session_id > :after"
    " ORDER BY session_id LIMIT :batch"
)
_READ = text(
    f"SELECT {runs.COLUMNS}, EXISTS (SELECT 1 FROM run_messages m WHERE m.session_id = runs.session_id)"
    " AS has_rows FROM runs WHERE session_id = :sid AND jsonb_exists(document, 'messages')"
)
# The run as it was read: a step's claim changes the fence, its save the seq and document, a deletion and a
# new run under the same id the transcript id.
_UNCHANGED = (
    "session_id = :sid AND seq = :seq AND fence = :fence AND transcript_id = :tid"
    " AND jsonb_exists(document, 'messages')"
)
_LOCK = text(f"SELECT 1 FROM runs WHERE {_UNCHANGED} FOR UPDATE")
# The rows, while the run is unchanged (its row locked until they are in).
_WRITE_ROWS = text(f"""
WITH unchanged AS (SELECT session_id FROM runs WHERE {_UNCHANGED} FOR UPDATE),
added AS ({runs.ADD_MESSAGES.strip()} WHERE EXISTS (SELECT 1 FROM unchanged)
  ON CONFLICT (session_id, slot) DO UPDATE SET message = EXCLUDED.message, seq = EXCLUDED.seq
),
gone AS (
  DELETE FROM run_messages WHERE session_id = :sid AND EXISTS (SELECT 1 FROM unchanged)
    AND slot NOT IN (SELECT CAST(e ->> 0 AS int) FROM jsonb_array_elements(CAST(:rows AS jsonb)) e)
)
SELECT count(*) FROM unchanged
""")
# Then the document, while the run is still as read (so the rows written are still its transcript).
_SET_DOCUMENT = text(
    f"UPDATE runs SET document = CAST(:doc AS jsonb), transcript_id = nextval('run_transcript_ids')"
    f" WHERE {_UNCHANGED} RETURNING 1"
)


@dataclass
class UpgradeReport:
    """What ``upgrade_runs`` did.

    ``skipped`` runs changed between their reading and their conversion (a worker stepped them: its save
    converts them); ``unreadable`` runs cannot be read and stay in format 1, the first ``NAMED_UNREADABLE``
    of them named in ``unreadable_runs``.
    """

    converted: int = 0
    skipped: int = 0
    unreadable: int = 0
    unreadable_runs: list[str] = field(default_factory=list)

    def count(self, outcome: Outcome, session_id: str) -> None:
        """Count the outcome of one run."""
        if outcome == "converted":
            self.converted += 1
        elif outcome == "skipped":
            self.skipped += 1
        else:
            self.unreadable += 1
            if len(self.unreadable_runs) < NAMED_UNREADABLE:
                self.unreadable_runs.append(session_id)


def upgrade_runs(engine: Engine, batch: int = 200) -> UpgradeReport:
    """Convert every run stored in checkpoint format 1 to format 2, ``batch`` run ids a page.

    Safe while workers run: a run that moves meanwhile is skipped, never overwritten. Running it again
    converts only what is left (skipped runs that did not save since, runs written by an old worker).

    Raises:
        ConfigurationError: ``batch`` is below 1.
        StorageError: the database failed (runs converted so far stay converted).
    """
    if batch < 1:
        raise errors.ConfigurationError(f"batch must be at least 1, not {batch}", field="batch")
    single = engine.execution_options(isolation_level="AUTOCOMMIT")
    report = UpgradeReport()
    after = ""
    while True:
        with Transaction(single) as conn:
            page = [str(sid) for sid in conn.execute(_PAGE, {"after": after, "batch": batch}).scalars()]
        for session_id in page:
            report.count(_upgrade(engine, single, session_id), session_id)
        if len(page) < batch:
            return report
        after = page[-1]


def _read_run(conn: Connection, session_id: str) -> Row[Any] | None:
    """The run's row (``runs.COLUMNS`` and ``has_rows``) while its document is in format 1, else None."""
    return conn.execute(_READ, {"sid": session_id}).first()


def _upgrade(engine: Engine, single: Engine, session_id: str) -> Outcome:
    """Convert one run, unless it changed since it was read or cannot be read."""
    with Transaction(single) as conn:
        row = _read_run(conn, session_id)
    if row is None:
        return "skipped"  # converted by a step's save, or deleted, since the page was read
    # The usage of unsaved model calls stays in its column: the document keeps only the saved usage.
    mapping = {**row._mapping, "uncounted_usage": None}
    try:
        checkpoint = runs.row_checkpoint(mapping, session_id)
    except (errors.CheckpointCorruptError, errors.CheckpointFormatError):
        return "unreadable"
    messages = checkpoint.messages
    params = {
        "sid": session_id,
        "seq": int(row.seq),
        "fence": int(row.fence),
        "tid": int(row.transcript_id),
        "doc": runs.format_document(checkpoint, len(messages)),
        "rows": "["
        + ",".join(
            f"[{slot},{payloads.dumps(message.dump())}]"
            for slot, message in zip(transcripts.slots_of(messages), messages, strict=True)
        )
        + "]",
    }
    if not _write_rows(engine, single, params, bool(row.has_rows)):
        return "skipped"
    with Transaction(single) as conn:
        moved = conn.execute(_SET_DOCUMENT, params).first()
    return "skipped" if moved is None else "converted"


def _write_rows(engine: Engine, single: Engine, params: dict[str, Any], has_rows: bool) -> bool:
    """Write the run's messages as rows while it is as read (``params``); False when it changed."""
    if not has_rows:
        with Transaction(single) as conn:
            return bool(conn.execute(_WRITE_ROWS, params).scalar_one())
    # Stored rows are rewritten: history entries pointing at them take their transcripts first. The run's row
    # is locked before the entries, in the order a save takes them.
    with Transaction(engine) as conn:
        if conn.execute(_LOCK, params).first() is None:
            return False
        history.make_standalone(conn, session_id=params["sid"])
        conn.execute(_WRITE_ROWS, params)
    return True
