"""The tables of the in-memory store: run rows, history rows, inbox, approvals and sends, under one lock.

Shared explicitly by the memory checkpoint and approval stores (as the Postgres ones share a database). It
must not decide anything a store method decides: only rows, their reading back, and what Postgres refuses.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from store import errors, records

#: Where the in-memory store and leases take "now" from (Postgres ``now()`` and Redis's clock).
Clock = Callable[[], datetime]


def utc_now() -> datetime:
    """The real time, for stores built without a fake clock."""
    return datetime.now(UTC)


@dataclass
class RunRow:
    """One ``runs`` row: control columns plus the JSON text of the document."""

    agent: str
    created_at: datetime
    updated_at: datetime
    status: records.Status = "in-progress"
    seq: int = 0
    fence: int = 0
    attempts: int = 0
    last_error: dict[str, Any] | None = None
    inbox_head: int = 0
    inbox_cursor: int = 0
    document: str = "{}"
    uncounted_usage: dict[str, Any] | None = None
    next_attempt_at: datetime | None = None
    retry_since: datetime | None = None
    failures: int = 0
    swept_at: datetime | None = None
    #: The sweep sent the run on and has not reported how it came out: ``{"seq", "failures"}`` as they were then.
    recovery: dict[str, int] | None = None
    aborted: bool = False
    end_due: bool = False
    waiting: bool = False
    parent_id: str | None = None
    abort_requested: bool = False
    events_next: int = 0

    def clear_failures(self) -> None:
        """Forget the attempts, error and retry time (a save, or new input from a person)."""
        self.attempts, self.last_error, self.failures = 0, None, 0
        self.retry_since = self.next_attempt_at = None

    def waiting_on(self) -> list[str]:
        """The approval ids the stored document waits on."""
        return list(json.loads(self.document).get("approval_ids") or [])


@dataclass(frozen=True)
class SavedRow:
    """One ``checkpoint_history`` row."""

    seq: int
    fence: int
    step: int
    status: records.Status
    saved_at: datetime
    document: str


@dataclass
class MemoryState:
    """Every table of one in-memory database; hold ``lock`` while reading or changing any of them."""

    clock: Clock = utc_now
    lock: threading.RLock = field(default_factory=threading.RLock)
    runs: dict[str, RunRow] = field(default_factory=dict)
    history: dict[str, dict[int, SavedRow]] = field(default_factory=dict)
    #: ``inbox``: per run, by number, the JSON text of the input's messages, or of ``{"messages", "metadata"}``
    #: when its send carried metadata.
    inbox: dict[str, dict[int, str]] = field(default_factory=dict)
    agents: dict[str, dict[str, Any]] = field(default_factory=dict)
    approvals: dict[str, records.Approval] = field(default_factory=dict)
    sends: dict[tuple[str, str], int] = field(default_factory=dict)
    #: ``run_events``: per run, ``(seq, type, at, data)`` with the message an event is about folded into its data.
    events: dict[str, list[tuple[int, str, datetime, dict[str, Any]]]] = field(default_factory=dict)

    def add_events(self, session_id: str, run: RunRow, drafts: Any, at: datetime) -> None:
        """Number ``drafts`` after the run's last event and keep them (call with the lock held)."""
        log = self.events.setdefault(session_id, [])
        for draft in drafts:
            data = dict(draft.data)
            if draft.message is not None:
                data["message"] = draft.message.dump()
            log.append((run.events_next, draft.type, at, json.loads(json.dumps(data))))
            run.events_next += 1

    def kept_seq(self, session_id: str) -> int:
        """The newest seq in a run's history (0 when none): a run recreated over kept history goes on from it."""
        return max(self.history.get(session_id, {}), default=0)


def refuse_nul(value: Any) -> None:
    """Postgres refuses a NUL character in text and jsonb; the fake refuses it the same way.

    Raises:
        StorageError: ``value`` holds a NUL somewhere.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                raise errors.StorageError("database error: UntranslatableCharacter")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def to_checkpoint(session_id: str, run: RunRow) -> records.Checkpoint:
    """The run's row as a checkpoint (``store.runs.row_checkpoint`` for a row in memory).

    Raises:
        CheckpointFormatError: the checkpoint was written in a newer format than this code reads.
        CheckpointCorruptError: the stored document cannot be read.
    """
    try:
        document = json.loads(run.document)
    except ValueError:
        document = None
    if not isinstance(document, dict):
        raise errors.CheckpointCorruptError(f"checkpoint of run {session_id!r} cannot be read")
    columns = {
        "agent": run.agent,
        "status": run.status,
        "seq": run.seq,
        "fence": run.fence,
        "attempts": run.attempts,
        "last_error": run.last_error,
        "inbox_cursor": run.inbox_cursor,
        "updated_at": run.updated_at,
        "next_attempt_at": run.next_attempt_at,
        "retry_since": run.retry_since,
        "failures": run.failures,
        "aborted": run.aborted,
        "end_due": run.end_due,
        "waiting": run.waiting,
    }
    return records.stored_checkpoint(session_id, columns, document, run.uncounted_usage)
