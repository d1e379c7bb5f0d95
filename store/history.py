"""How history entries are stored so that a long run's history grows linearly, not with its square.

Within a run a transcript only changes at its tail, so an entry stores the messages it shares with
the entry before it as a count (``keep``) and only the rest as ``tail``. Every ``KEYFRAME_EVERY``
saves (and whenever the previous entry is not known) an entry stores the whole transcript
(``keep = 0``), and the ring is trimmed at a keyframe so every kept entry can be rebuilt.
Rows written before this format (a full ``messages`` list) read as keyframes. Owns that format, the ring's
trim rule and reading entries back; the fenced save of ``store.checkpoints`` writes an entry with its run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from store import records
from store.records import Message

KEYFRAME_EVERY = 16
#: The part of the fenced save (after its ``saved`` CTE) that adds entry ``:entry`` as ``:seq`` and trims the
#: ring: it is cut at the newest keyframe at least ``:keep`` entries old, so every kept entry can be rebuilt;
#: between ``keep`` and ``keep + KEYFRAME_EVERY`` entries stay.
SAVE_ENTRY = """,
hist AS (
  INSERT INTO checkpoint_history (session_id, seq, fence, step, status, saved_at, document)
  SELECT session_id, :seq, :fence, :step, :status, updated_at, CAST(:entry AS jsonb) FROM saved
),
trimmed AS (
  DELETE FROM checkpoint_history
  WHERE session_id = :sid AND EXISTS (SELECT 1 FROM saved) AND seq < (
    SELECT max(seq) FROM checkpoint_history
    WHERE session_id = :sid AND seq <= :seq - :keep AND NOT jsonb_exists(document, 'messages_keep'))
)"""
_ENTRIES = text(
    "SELECT h.seq, h.fence, h.step, h.status, h.saved_at, h.document, r.agent FROM checkpoint_history h"
    " LEFT JOIN runs r ON r.session_id = h.session_id WHERE h.session_id = :sid ORDER BY h.seq")


def shared_prefix(before: Sequence[Message], after: Sequence[Message]) -> int:
    """How many leading messages ``after`` shares with ``before`` (identity first: saves share objects)."""
    limit = min(len(before), len(after))
    index = 0
    while index < limit and (before[index] is after[index] or before[index] == after[index]):
        index += 1
    return index


def entry_document(document: dict[str, Any], keep: int) -> dict[str, Any]:
    """The history form of a checkpoint document: its first ``keep`` messages left out."""
    if keep <= 0:
        return document
    entry = {k: v for k, v in document.items() if k != "messages"}
    entry["messages_keep"] = keep
    entry["messages_tail"] = list(document.get("messages") or [])[keep:]
    return entry


def is_keyframe(document: dict[str, Any]) -> bool:
    """Whether an entry holds its whole transcript."""
    return "messages_keep" not in document


def expand(rows: Iterable[tuple[int, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]]:
    """Rebuild full documents from ``(seq, document)`` rows in ascending seq order.

    A delta whose base entry is missing (trimmed or never written) cannot be rebuilt and is left out.
    """
    rebuilt: list[tuple[int, dict[str, Any]]] = []
    previous: tuple[int, list[Any]] | None = None
    for seq, document in rows:
        if is_keyframe(document):
            messages = list(document.get("messages") or [])
            rebuilt.append((seq, document))
        elif previous is not None and previous[0] == seq - 1 and len(previous[1]) >= document["messages_keep"]:
            messages = previous[1][:document["messages_keep"]] + list(document.get("messages_tail") or [])
            full = {k: v for k, v in document.items() if k not in ("messages_keep", "messages_tail")}
            full["messages"] = messages
            rebuilt.append((seq, full))
        else:
            previous = None
            continue
        previous = (seq, messages)
    return rebuilt


def entry(session_id: str, agent: str, document: dict[str, Any], *, step: int, seq: int, fence: int,
          status: records.Status, saved_at: datetime) -> records.HistoryEntry:
    """A rebuilt entry document and its columns as a ``HistoryEntry`` (``agent`` when the document has none)."""
    fields = {k: v for k, v in document.items() if k != "session_id"}
    fields.setdefault("agent", agent)
    checkpoint = records.Checkpoint(session_id=session_id, status=status, seq=seq, fence=fence, updated_at=saved_at,
                                    **fields)
    return records.HistoryEntry(step=step, seq=seq, saved_at=saved_at, status=status, checkpoint=checkpoint)


def read(conn: Connection, session_id: str, wanted: int | None) -> list[records.HistoryEntry]:
    """The rebuildable entries of a run, newest first, at most ``wanted`` of them (None: all)."""
    rows = {row.seq: row for row in conn.execute(_ENTRIES, {"sid": session_id}).all()}
    entries: list[records.HistoryEntry] = []
    for seq, document in reversed(expand((seq, row.document) for seq, row in rows.items())):
        if wanted is not None and len(entries) >= wanted:
            break
        row = rows[seq]
        entries.append(entry(session_id, row.agent or "", document, step=row.step, seq=row.seq, fence=row.fence,
                             status=row.status, saved_at=row.saved_at))
    return entries


class Bases:
    """Per run, the seq and transcript of its newest history entry written or loaded in this process.

    The next entry of the run is stored as a delta against it; a run not remembered gets a keyframe.
    """

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._bases: OrderedDict[str, tuple[int, list[Message]]] = OrderedDict()

    def remember(self, session_id: str, seq: int, messages: list[Message]) -> None:
        """Note the transcript of the entry ``seq`` of a run, the base of the next entry's delta."""
        self._bases[session_id] = (seq, messages)
        while len(self._bases) > self._size:
            self._bases.popitem(last=False)

    def shared(self, session_id: str, seq: int, messages: Sequence[Message]) -> int:
        """How many leading messages the entry ``seq`` may leave to its base (0: store a keyframe).

        The base is forgotten: the caller remembers the new entry once it is written.
        """
        base = self._bases.pop(session_id, None)
        if base is None or base[0] != seq - 1 or not seq % KEYFRAME_EVERY:
            return 0
        return shared_prefix(base[1], messages)
