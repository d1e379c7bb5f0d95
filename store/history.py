"""History entries: how they are stored, the ring's trim rule, and reading entries back.

Since checkpoint format 2 an entry is the run's document as that save wrote it (no transcript, its
``messages_count``): its transcript is the run's message rows written by saves up to its seq
(``store.transcripts``), so an entry costs the same at step 5 and at step 500. Entries written before,
in format 1, hold a whole transcript (a keyframe) or what they add to the entry before them
(``messages_keep`` and ``messages_tail``); they stay readable. The fenced save of ``store.checkpoints``
writes an entry with its run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from store import payloads, records

#: The part of the fenced save (after its ``saved`` CTE) that adds the save's document as entry ``:seq`` and
#: trims the ring: it is cut at the newest keyframe at least ``:keep`` entries old, so every kept entry can be
#: rebuilt (every format-2 entry stands alone); between ``keep`` and ``keep + 16`` entries stay while older
#: format-1 entries remain.
SAVE_ENTRY = """,
hist AS (
  INSERT INTO checkpoint_history (session_id, seq, fence, step, status, saved_at, document)
  SELECT session_id, :seq, :fence, :step, :status, updated_at, (SELECT body FROM doc) FROM saved
),
trimmed AS (
  DELETE FROM checkpoint_history
  WHERE session_id = :sid AND EXISTS (SELECT 1 FROM saved) AND seq < (
    SELECT max(seq) FROM checkpoint_history
    WHERE session_id = :sid AND seq <= :seq - :keep AND NOT jsonb_exists(document, 'messages_keep'))
)"""
_ENTRIES = text(
    "SELECT h.seq, h.fence, h.step, h.status, h.saved_at, h.document, r.agent FROM checkpoint_history h"
    " LEFT JOIN runs r ON r.session_id = h.session_id WHERE h.session_id = :sid ORDER BY h.seq"
)
_REPLACE_ENTRY = text(
    "UPDATE checkpoint_history SET document = CAST(:doc AS jsonb) WHERE session_id = :sid AND seq = :seq"
)
_MESSAGE_ROWS = text("SELECT slot, seq, message FROM run_messages WHERE session_id = :sid ORDER BY slot")
#: A stored message row: ``(slot, seq, message)``.
MessageRow = tuple[int, int, dict[str, Any]]


def is_keyframe(document: dict[str, Any]) -> bool:
    """Whether an entry holds its whole transcript."""
    return "messages_keep" not in document


def expand(
    rows: Iterable[tuple[int, dict[str, Any]]], stored: Sequence[MessageRow] = ()
) -> list[tuple[int, dict[str, Any]]]:
    """Rebuild full documents from ``(seq, document)`` rows in ascending seq order.

    ``stored`` are the run's message rows in slot order, which format-2 entries point at. A delta whose
    base entry is missing (trimmed or never written), or a format-2 entry whose rows were since rewritten,
    cannot be rebuilt and is left out.
    """
    rebuilt: list[tuple[int, dict[str, Any]]] = []
    previous: tuple[int, list[Any]] | None = None
    for seq, document in rows:
        if "messages_count" in document:
            found = [body for _, written, body in stored if written <= seq]
            if len(found) != document["messages_count"]:
                previous = None
                continue
            full = {k: v for k, v in document.items() if k not in ("messages_count", "format")}
            full["messages"] = found
            rebuilt.append((seq, full))
            previous = (seq, found)
            continue
        if is_keyframe(document):
            messages = list(document.get("messages") or [])
            rebuilt.append((seq, document))
        elif previous is not None and previous[0] == seq - 1 and len(previous[1]) >= document["messages_keep"]:
            messages = previous[1][: document["messages_keep"]] + list(document.get("messages_tail") or [])
            full = {k: v for k, v in document.items() if k not in ("messages_keep", "messages_tail")}
            full["messages"] = messages
            rebuilt.append((seq, full))
        else:
            previous = None
            continue
        previous = (seq, messages)
    return rebuilt


def entry(
    session_id: str,
    agent: str,
    document: dict[str, Any],
    *,
    step: int,
    seq: int,
    fence: int,
    status: records.Status,
    saved_at: datetime,
) -> records.HistoryEntry:
    """A rebuilt entry document and its columns as a ``HistoryEntry`` (``agent`` when the document has none)."""
    fields = {k: v for k, v in document.items() if k != "session_id"}
    fields.setdefault("agent", agent)
    checkpoint = records.Checkpoint(
        session_id=session_id, status=status, seq=seq, fence=fence, updated_at=saved_at, **fields
    )
    return records.HistoryEntry(step=step, seq=seq, saved_at=saved_at, status=status, checkpoint=checkpoint)


def message_rows(conn: Connection, session_id: str) -> list[MessageRow]:
    """The run's stored message rows, in slot order."""
    return [(row.slot, row.seq, row.message) for row in conn.execute(_MESSAGE_ROWS, {"sid": session_id})]


def read(conn: Connection, session_id: str, wanted: int | None) -> list[records.HistoryEntry]:
    """The rebuildable entries of a run, newest first, at most ``wanted`` of them (None: all)."""
    rows = {row.seq: row for row in conn.execute(_ENTRIES, {"sid": session_id}).all()}
    messages = message_rows(conn, session_id) if rows else []
    entries: list[records.HistoryEntry] = []
    for seq, document in reversed(expand(((seq, row.document) for seq, row in rows.items()), messages)):
        if wanted is not None and len(entries) >= wanted:
            break
        row = rows[seq]
        entries.append(
            entry(
                session_id,
                row.agent or "",
                document,
                step=row.step,
                seq=row.seq,
                fence=row.fence,
                status=row.status,
                saved_at=row.saved_at,
            )
        )
    return entries


def make_standalone(conn: Connection, session_id: str) -> int:
    """Give every rebuildable format-2 entry of the run its whole transcript (before its message rows go).

    Entries that cannot be rebuilt are dropped. Returns how many entries were rewritten.
    """
    rows = conn.execute(_ENTRIES, {"sid": session_id}).all()
    pointing = {row.seq for row in rows if "messages_count" in (row.document or {})}
    if not pointing:
        return 0
    rebuilt = dict(expand(((row.seq, row.document) for row in rows), message_rows(conn, session_id)))
    for seq in sorted(pointing):
        if seq in rebuilt:
            conn.execute(_REPLACE_ENTRY, {"sid": session_id, "seq": seq, "doc": payloads.dumps(rebuilt[seq])})
        else:
            conn.execute(
                text("DELETE FROM checkpoint_history WHERE session_id = :sid AND seq = :seq"),
                {"sid": session_id, "seq": seq},
            )
    return len(pointing)
