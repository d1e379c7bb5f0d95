"""In-memory checkpoint store, approvals and run leases, for the unit tests of the step machine only.

The product always runs on Postgres (``store.checkpoints``, ``store.approvals``) and Redis
(``store.leases``). These mirror their semantics (fence claims, seq, history ring, inbox, attempts,
decisions, fencing tokens) under a lock, with an injectable clock so lease expiry and staleness are
simulated without sleeping.
"""

from __future__ import annotations

import builtins
import itertools
import json
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from store import errors, keys, payloads, records, runs
from store.approvals import Decision
from store.checkpoints import Claim
from store.leases import Lease

#: Where the in-memory store and leases take "now" from (Postgres ``now()`` and Redis's clock).
Clock = Callable[[], datetime]


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class _Run:
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

    def clear_failures(self) -> None:
        self.attempts, self.last_error, self.failures = 0, None, 0
        self.retry_since = self.next_attempt_at = None


@dataclass(frozen=True)
class _Saved:
    """One ``checkpoint_history`` row."""

    seq: int
    fence: int
    step: int
    status: records.Status
    saved_at: datetime
    document: str


def _refuse_nul(value: Any) -> None:
    """Postgres refuses ``\\u0000`` in text and jsonb; the fake refuses it the same way."""
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


def _to_checkpoint(session_id: str, run: _Run) -> records.Checkpoint:
    try:
        document = dict(json.loads(run.document))
        document.pop("session_id", None)
        document.pop("agent", None)
        found_format = document.pop("format", records.CHECKPOINT_FORMAT)
        if isinstance(found_format, int) and found_format > records.CHECKPOINT_FORMAT:
            raise errors.CheckpointFormatError(session_id, found_format, records.CHECKPOINT_FORMAT)
        last_error = None if run.last_error is None else records.LastError.model_validate(run.last_error)
        checkpoint = records.Checkpoint(
            session_id=session_id, agent=run.agent, status=run.status, seq=run.seq, fence=run.fence,
            attempts=run.attempts, last_error=last_error, inbox_cursor=run.inbox_cursor,
            updated_at=run.updated_at, next_attempt_at=run.next_attempt_at, retry_since=run.retry_since,
            failures=run.failures, **document)
        if run.uncounted_usage:
            extra = records.Usage.model_validate(run.uncounted_usage)
            checkpoint = checkpoint.model_copy(update={"usage": checkpoint.usage + extra, "uncounted_usage": extra})
        return checkpoint
    except (ValueError, TypeError) as exc:
        raise errors.CheckpointCorruptError(f"checkpoint of run {session_id!r} cannot be read") from exc


class MemoryCheckpointStore:
    """``PostgresCheckpointStore`` semantics over dicts; every method is atomic under one lock."""

    def __init__(self, history_limit: int = 50, clock: Clock = _utc_now) -> None:
        self.history_limit = history_limit
        self._clock = clock
        self._lock = threading.RLock()
        self._runs: dict[str, _Run] = {}
        self._history: dict[str, dict[int, _Saved]] = {}
        self._inbox: dict[str, dict[int, str]] = {}
        self._agents: dict[str, dict[str, Any]] = {}
        self._approvals: dict[str, records.Approval] = {}
        self._sends: dict[tuple[str, str], int] = {}

    # -- the step's hot path ---------------------------------------------------------------

    def claim(self, session_id: str, token: int, seq: int | None) -> Claim:
        """Claim ``token`` as the run's fence and load the run (see ``PostgresCheckpointStore.claim``)."""
        with self._lock:
            run = self._runs.get(session_id)
            if run is None:
                return Claim(None, stored_fence=None)
            if not run.fence < token:
                return Claim(None, stored_fence=run.fence)
            if (seq is None or run.seq == seq) and runs.has_work(run):
                run.attempts += 1
            run.fence = token
            return Claim(_to_checkpoint(session_id, run), inbox_head=run.inbox_head, now=self._clock())

    def inbox(self, session_id: str, cursor: int) -> list[records.InboxEntry]:
        """Input sent after ``cursor``, in send order."""
        with self._lock:
            entries = sorted((n, body) for n, body in self._inbox.get(session_id, {}).items() if n > cursor)
        return [records.InboxEntry(n=n, messages=json.loads(body)) for n, body in entries]

    def save(self, checkpoint: records.Checkpoint, *, drained_inbox: bool = False,
             approvals: Sequence[records.Approval] = ()) -> datetime | None:
        """Write ``checkpoint`` if its fence holds and its seq is the stored one plus one.

        New approval rows (a pausing save) are kept with it. Returns the save time, or None when
        refused.

        Raises:
            InputTooLargeError: the serialized checkpoint is over the size limit.
            StorageError: the document holds a NUL (as Postgres refuses it), or the history
                ring already has this seq (a primary-key violation in Postgres).
        """
        if self.history_limit > 0:
            checkpoint = checkpoint.model_copy(update={"history_seq": checkpoint.seq})
        document = checkpoint.document()
        body = payloads.dumps(document)
        if len(body) > payloads.MAX_CHECKPOINT:
            raise errors.InputTooLargeError(f"checkpoint of {len(body)} bytes is over the limit")
        _refuse_nul(document)
        sid = checkpoint.session_id
        with self._lock:
            run = self._runs.get(sid)
            if run is None or run.fence != checkpoint.fence or run.seq != checkpoint.seq - 1:
                return None
            history = self._history.setdefault(sid, {})
            if self.history_limit > 0 and checkpoint.seq in history:
                raise errors.StorageError("database error: UniqueViolation")
            now = self._clock()
            run.status, run.seq = checkpoint.status, checkpoint.seq
            run.clear_failures()
            run.uncounted_usage = None
            run.inbox_cursor, run.document, run.updated_at = checkpoint.inbox_cursor, body, now
            if self.history_limit > 0:
                history[checkpoint.seq] = _Saved(checkpoint.seq, checkpoint.fence, checkpoint.step,
                                                 checkpoint.status, now, body)
                for old in [s for s in history if s <= checkpoint.seq - self.history_limit]:
                    del history[old]
            if drained_inbox:
                inbox = self._inbox.get(sid, {})
                for n in [n for n in inbox if n <= checkpoint.inbox_cursor]:
                    del inbox[n]
            for approval in approvals:
                stored = approval.model_copy(update={"args": payloads.sanitize(approval.args), "created_at": now,
                                                     "status": "pending", "note": None, "decided_at": None})
                self._approvals.setdefault(approval.approval_id, stored)
            return now

    def note_usage(self, session_id: str, fence: int, usage: records.Usage) -> bool:
        """Keep a model call's usage before its turn is saved, so a crash in between still counts it."""
        record = usage.model_dump()
        payloads.dumps(record)
        with self._lock:
            run = self._runs.get(session_id)
            if run is None or run.fence != fence:
                return False
            run.uncounted_usage = record
            return True

    def _failed(self, session_id: str, fence: int, error: records.LastError) -> _Run | None:
        """The run with ``error`` recorded under its fence (call with the lock held); None if fenced out."""
        record = error.model_dump()
        payloads.dumps(record)
        _refuse_nul(record)
        run = self._runs.get(session_id)
        if run is None or run.fence != fence:
            return None
        run.last_error, run.updated_at = record, self._clock()
        return run

    def record_failure(self, session_id: str, fence: int, error: records.LastError) -> int | None:
        """Store why a step failed (fenced); returns the attempts count, None if fenced out."""
        with self._lock:
            run = self._failed(session_id, fence, error)
            if run is None:
                return None
            run.next_attempt_at = None
            return run.attempts

    def retry_later(self, session_id: str, fence: int, error: records.LastError, delay_s: float) -> int | None:
        """Record a transient failure and when to try again (see ``PostgresCheckpointStore.retry_later``)."""
        with self._lock:
            run = self._failed(session_id, fence, error)
            if run is None:
                return None
            run.attempts, run.failures = 0, run.failures + 1
            run.retry_since = run.retry_since or run.updated_at
            run.next_attempt_at = run.updated_at + timedelta(seconds=max(delay_s, 0.0))
            return run.seq

    def refuse(self, session_id: str, fence: int, error: records.LastError, approval_ids: Sequence[str]) -> bool:
        """Park the run with a non-retryable ``error``, leaving its checkpoint as it was.

        Decisions of ``approval_ids`` go back to pending and the run back to awaiting approval.
        """
        record = error.model_copy(update={"retryable": False}).model_dump()
        with self._lock:
            run = self._runs.get(session_id)
            if run is None or run.fence != fence:
                return False
            run.last_error, run.updated_at = record, self._clock()
            if approval_ids:
                for approval_id in approval_ids:
                    approval = self._approvals.get(approval_id)
                    if approval is not None and approval.status in ("approved", "rejected"):
                        self._approvals[approval_id] = approval.model_copy(
                            update={"status": "pending", "note": None, "decided_at": None})
                if run.status == "in-progress":
                    run.status = "awaiting-approval"
            return True

    def decisions(self, approval_ids: Sequence[str]) -> dict[str, records.Approval]:
        """The approvals of a pause, by id (missing ids are left out)."""
        with self._lock:
            return {a: self._approvals[a] for a in approval_ids if a in self._approvals}

    # -- producers -------------------------------------------------------------------------

    def append_input(self, session_id: str, agent: str, messages: Sequence[records.Message],
                     idempotency_key: str | None = None) -> int:
        """Queue input for a run (creating the run) and return its per-run inbox number.

        Raises:
            SessionAwaitingApprovalError: the run waits on an approval.
            ConfigurationError: the session belongs to another agent.
            CheckpointCorruptError: the stored run cannot be read.
        """
        dumped = [m.dump() for m in messages]
        body = payloads.dumps(dumped)
        _refuse_nul([session_id, agent, dumped])
        with self._lock:
            earlier = self._sends.get((session_id, idempotency_key)) if idempotency_key is not None else None
            run = self._runs.get(session_id)
            if earlier is not None and run is not None:
                return earlier
            if run is None:
                now = self._clock()
                # Like Postgres: a run recreated over kept history continues its seq after it.
                kept = max(self._history.get(session_id, {}), default=0)
                run = _Run(agent=agent, created_at=now, updated_at=now, seq=kept, inbox_head=1)
                self._runs[session_id] = run
                number = 1
            else:
                if json.loads(run.document):
                    _to_checkpoint(session_id, run)  # an unreadable run takes no input: delete it first
                if run.agent != agent:
                    raise errors.ConfigurationError(
                        f"session {session_id!r} belongs to agent {run.agent!r}, not {agent!r}")
                if run.status == "awaiting-approval":
                    approvals = json.loads(run.document).get("approval_ids") or []
                    raise errors.SessionAwaitingApprovalError(session_id, approvals[0] if approvals else None)
                run.inbox_head += 1
                run.clear_failures()
                number = run.inbox_head
            self._inbox.setdefault(session_id, {})[number] = body
            if idempotency_key is not None:
                self._sends[(session_id, idempotency_key)] = number
            return number

    def create_run(self, checkpoint: records.Checkpoint, queued: Sequence[records.Message] = ()) -> bool:
        """Store a new run as ``checkpoint`` (a fork), with ``queued`` input; False if the id is taken."""
        document = checkpoint.model_copy(update={"history_seq": None}).document()
        body = payloads.dumps(document)
        queued_body = payloads.dumps([m.dump() for m in queued])
        _refuse_nul([document, checkpoint.agent])
        sid = checkpoint.session_id
        with self._lock:
            if sid in self._runs:
                return False
            now = self._clock()
            self._runs[sid] = _Run(agent=checkpoint.agent, created_at=now, updated_at=now,
                                   status=checkpoint.status, seq=max(self._history.get(sid, {}), default=0),
                                   inbox_head=1 if queued else 0, document=body)
            if queued:
                self._inbox.setdefault(sid, {})[1] = queued_body
            return True

    def reset_attempts(self, session_id: str) -> int | None:
        """Clear a parked run's error so it runs again; returns its seq, None if not in progress."""
        with self._lock:
            run = self._runs.get(session_id)
            if run is None or not runs.has_work(run):
                return None
            run.clear_failures()
            return run.seq

    # -- readers ---------------------------------------------------------------------------

    def load(self, session_id: str) -> records.Checkpoint | None:
        """The latest checkpoint of a run, or None.

        Raises:
            CheckpointCorruptError: the stored document does not parse as a checkpoint.
        """
        with self._lock:
            run = self._runs.get(session_id)
            return None if run is None else _to_checkpoint(session_id, run)

    def progress(self, session_id: str) -> records.Progress | None:
        """A run's status, inbox cursor and last error, without its transcript; None if unknown."""
        with self._lock:
            run = self._runs.get(session_id)
            if run is None:
                return None
            error = None if run.last_error is None else records.LastError.model_validate(run.last_error)
            return records.Progress(status=run.status, inbox_cursor=run.inbox_cursor, last_error=error)

    def list(self, *, statuses: Iterable[str] | None = None, agent: str | None = None,
             limit: int = 1000) -> builtins.list[records.Checkpoint | records.PendingRun]:
        """Latest checkpoints by creation, optionally filtered; an unreadable one comes as a PendingRun."""
        wanted = None if statuses is None else set(statuses)
        with self._lock:
            rows = sorted(
                ((run.created_at, sid, run) for sid, run in self._runs.items()
                 if (wanted is None or run.status in wanted) and (agent is None or run.agent == agent)),
                key=lambda item: (item[0], item[1]))[:limit]
            found: builtins.list[records.Checkpoint | records.PendingRun] = []
            for _, sid, run in rows:
                try:
                    found.append(_to_checkpoint(sid, run))
                except (errors.CheckpointCorruptError, errors.CheckpointFormatError) as exc:
                    found.append(records.PendingRun(
                        session_id=sid, checkpoint_id=sid, status="in-progress", step=0,
                        last_error=records.LastError(**exc.to_record()), attempts=run.attempts, agent=run.agent))
            return found

    def history(self, session_id: str, limit: int | None = None) -> builtins.list[records.HistoryEntry]:
        """Saved states of a run, newest first; ``[]`` for an unknown run."""
        with self._lock:
            saved = sorted(self._history.get(session_id, {}).values(), key=lambda s: s.seq, reverse=True)
            run = self._runs.get(session_id)
            agent = run.agent if run is not None else ""
        if limit is not None:
            saved = saved[:limit]
        entries = []
        for row in saved:
            document = dict(json.loads(row.document))
            document.setdefault("agent", agent)
            document.pop("session_id", None)
            checkpoint = records.Checkpoint(session_id=session_id, status=row.status, seq=row.seq, fence=row.fence,
                                            updated_at=row.saved_at, **document)
            entries.append(records.HistoryEntry(step=row.step, seq=row.seq, saved_at=row.saved_at,
                                                status=row.status, checkpoint=checkpoint))
        return entries

    def stale_runs(self, stale_after_s: float, limit: int = 500) -> builtins.list[tuple[str, int]]:
        """Runs that should be moving and did not save for ``stale_after_s``: (session_id, seq)."""
        return [(run.session_id, run.seq) for run in self.due_runs(stale_after_s, limit)]

    def due_runs(self, stale_after_s: float, limit: int = 500,
                 after: records.DueRun | None = None) -> builtins.list[records.DueRun]:
        """Runs a step can move now, most overdue first (see ``PostgresCheckpointStore.due_runs``)."""
        with self._lock:
            now = self._clock()
            cutoff = now - timedelta(seconds=stale_after_s)
            found = []
            for sid, run in self._runs.items():
                if not (runs.has_work(run) and not runs.is_parked(run.last_error)):
                    continue
                due = run.next_attempt_at or run.updated_at
                if run.swept_at is not None and run.swept_at >= cutoff:
                    continue
                if (run.next_attempt_at is None and run.updated_at < cutoff) or (
                        run.next_attempt_at is not None and run.next_attempt_at <= now):
                    if after is None or (due, sid) > (after.due, after.session_id):
                        found.append(records.DueRun(session_id=sid, seq=run.seq, agent=run.agent,
                                                    retrying=run.next_attempt_at is not None, due=due))
        found.sort(key=lambda r: (r.due, r.session_id))
        return found[:limit]

    def mark_swept(self, session_ids: Sequence[str]) -> None:
        """Note that the sweep just sent a step for these runs (see ``PostgresCheckpointStore.mark_swept``)."""
        with self._lock:
            now = self._clock()
            for session_id in session_ids:
                run = self._runs.get(session_id)
                if run is not None:
                    run.swept_at = now

    def pending(self, agent: str | None = None, limit: int = 1000) -> builtins.list[records.PendingRun]:
        """Runs that are not finished, oldest first (see ``PostgresCheckpointStore.pending``)."""
        with self._lock:
            rows = sorted(((run.created_at, sid, run) for sid, run in self._runs.items()
                           if (run.status == "awaiting-approval" or runs.has_work(run))
                           and (agent is None or run.agent == agent)), key=lambda item: (item[0], item[1]))[:limit]
            found = []
            for _, sid, run in rows:
                try:
                    found.append(records.pending_run(_to_checkpoint(sid, run)))
                except (errors.CheckpointCorruptError, errors.CheckpointFormatError) as exc:
                    error = records.LastError(**exc.to_record())
                    found.append(records.PendingRun(
                        session_id=sid, checkpoint_id=sid, status=run.status, step=0, last_error=error,
                        attempts=run.attempts, agent=run.agent, state=records.run_state(run.status, error),
                        next_attempt_at=run.next_attempt_at))
            return found

    # -- maintenance -------------------------------------------------------------------------

    def delete(self, session_id: str, *, keep_history: bool = False) -> bool:
        """Drop a run's checkpoint and inbox (and its history unless ``keep_history``)."""
        with self._lock:
            deleted = self._runs.pop(session_id, None) is not None
            now = self._clock()
            for approval_id, approval in self._approvals.items():
                if approval.session_id == session_id and approval.status == "pending":
                    withdrawn = {"status": "withdrawn", "decided_at": now}
                    self._approvals[approval_id] = approval.model_copy(update=withdrawn)
            self._inbox.pop(session_id, None)
            for key in [k for k in self._sends if k[0] == session_id]:
                del self._sends[key]
            if not keep_history:
                self._history.pop(session_id, None)
            return deleted

    def prune(self, older_than: datetime) -> int:
        """Drop finished runs last saved before ``older_than`` and history entries older than it.

        Raises:
            ConfigurationError: ``older_than`` is a naive datetime.
        """
        if older_than.tzinfo is None:
            raise errors.ConfigurationError("prune needs a timezone-aware cutoff")
        with self._lock:
            doomed = [sid for sid, run in self._runs.items() if run.status == "finished"
                      and run.inbox_head <= run.inbox_cursor and run.updated_at < older_than]
            for sid in doomed:
                del self._runs[sid]
            for history in self._history.values():
                for seq in [seq for seq, row in history.items() if row.saved_at < older_than]:
                    del history[seq]
            return len(doomed)

    def register_agents(self, fingerprints: dict[str, dict[str, Any]]) -> None:
        """Record the agents a worker serves, so producers can refuse unknown names."""
        with self._lock:
            self._agents.update(fingerprints)

    def known_agents(self) -> builtins.list[str]:
        """Names of agents some worker registered."""
        with self._lock:
            return sorted(self._agents)

    def approvals_of(self, session_id: str) -> builtins.list[records.Approval]:
        """Approval rows created by the saves of a run, oldest first."""
        with self._lock:
            return [a for a in self._approvals.values() if a.session_id == session_id]

    # -- test hooks --------------------------------------------------------------------------

    def overwrite_document(self, session_id: str, document: Any) -> None:
        """Replace a run's stored document verbatim (to simulate corruption in tests)."""
        with self._lock:
            self._runs[session_id].document = json.dumps(document)


class MemoryApprovalStore:
    """``PostgresApprovalStore`` semantics over the approvals of a ``MemoryCheckpointStore``."""

    def __init__(self, store: MemoryCheckpointStore) -> None:
        self._store = store

    def by_ids(self, approval_ids: Sequence[str]) -> dict[str, records.Approval]:
        """Approvals by id (missing ids are left out)."""
        return self._store.decisions(approval_ids)

    def pending(self, agent: str | None = None, limit: int = 1000) -> builtins.list[records.Approval]:
        """Undecided approvals, oldest first."""
        with self._store._lock:
            found = [a for a in self._store._approvals.values()
                     if a.status == "pending" and (agent is None or a.agent == agent)]
        return sorted(found, key=lambda a: (a.created_at or datetime.min.replace(tzinfo=UTC), a.approval_id))[:limit]

    def resolve(self, approval_id: str, approved: bool, note: str | None = None) -> Decision:
        """Decide an approval once.

        Raises:
            ApprovalNotFoundError: unknown, or already decided.
            ApprovalOrphanedError: its run is gone, replaced or waits on other approvals; it is
                withdrawn (or was already) and nothing runs.
        """
        if note is not None:
            note = payloads.truncate_text(payloads.clean_text(note), 10_000)
        store = self._store
        with store._lock:
            approval = store._approvals.get(approval_id)
            if approval is not None and approval.status == "withdrawn":
                raise errors.ApprovalOrphanedError(
                    f"approval {approval_id!r} was withdrawn: its run was deleted or replaced",
                    approval_id=approval_id, session_id=approval.session_id)
            if approval is None or approval.status != "pending":
                state = "unknown" if approval is None else f"already {approval.status}"
                raise errors.ApprovalNotFoundError(f"approval {approval_id!r} is {state}")
            now = store._clock()
            run = store._runs.get(approval.session_id)
            waiting_on = (json.loads(run.document).get("approval_ids") or []) if run is not None else []
            if run is None or run.status != "awaiting-approval" or approval_id not in waiting_on:
                store._approvals[approval_id] = approval.model_copy(
                    update={"status": "withdrawn", "note": None, "decided_at": now})
                raise errors.ApprovalOrphanedError(
                    f"approval {approval_id!r} belongs to a run that no longer waits on it; it was withdrawn",
                    approval_id=approval_id, session_id=approval.session_id)
            status: records.ApprovalStatus = "approved" if approved else "rejected"
            store._approvals[approval_id] = approval.model_copy(
                update={"status": status, "note": note, "decided_at": now})
            waiting = sum(1 for a in waiting_on if a in store._approvals and store._approvals[a].status == "pending")
            if waiting == 0:
                run.status, run.last_error, run.attempts = "in-progress", None, 0
            return Decision(approval.model_copy(update={"status": status, "note": note}), waiting == 0)


@dataclass
class _Held:
    owner: str
    expires_at: datetime


@dataclass
class _Counter:
    value: int
    expires_at: datetime


@dataclass
class MemoryLeaseManager:
    """``LeaseManager`` semantics over dicts: SET NX PX leases and INCR fencing counters.

    ``flush_all`` drops every lease and counter, as a Redis restarted without persistence would.
    """

    ttl_ms: int
    clock: Clock = _utc_now
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _leases: dict[str, _Held] = field(default_factory=dict, repr=False)
    _counters: dict[str, _Counter] = field(default_factory=dict, repr=False)
    _owners: itertools.count[int] = field(default_factory=lambda: itertools.count(1), repr=False)

    def acquire(self, session_id: str, floor: int = 0) -> Lease | None:
        """Take the run's lease and mint a fencing token above ``floor``; ``None`` when held."""
        records.validate_session_id(session_id)
        with self._lock:
            now = self.clock()
            if self._live(session_id, now) is not None:
                return None
            owner = f"memory:{next(self._owners)}"
            self._leases[session_id] = _Held(owner, now + timedelta(milliseconds=self.ttl_ms))
            return Lease(session_id, owner, self._next_token(session_id, floor, now))

    def raise_token(self, lease: Lease, floor: int) -> bool:
        """Give ``lease`` a new token above ``floor`` if it is still held; False when it is not."""
        with self._lock:
            now = self.clock()
            held = self._live(lease.session_id, now)
            if held is None or held.owner != lease.owner:
                return False
            lease.token = self._next_token(lease.session_id, floor, now)
            return True

    def renew(self, lease: Lease) -> bool:
        """Push the lease's expiry out by one TTL; False (and ``lost`` set) when not ours anymore."""
        with self._lock:
            now = self.clock()
            held = self._live(lease.session_id, now)
            if held is None or held.owner != lease.owner:
                lease.lost.set()
                return False
            held.expires_at = now + timedelta(milliseconds=self.ttl_ms)
            return True

    def renew_many(self, leases: list[Lease]) -> None:
        """Renew several leases."""
        for lease in leases:
            self.renew(lease)

    def release(self, lease: Lease) -> bool:
        """Drop the lease if we still own it."""
        with self._lock:
            held = self._live(lease.session_id, self.clock())
            if held is None or held.owner != lease.owner:
                return False
            del self._leases[lease.session_id]
            return True

    def holder(self, session_id: str) -> str | None:
        """The owner id of the live lease on a run, if any."""
        records.validate_session_id(session_id)
        with self._lock:
            held = self._live(session_id, self.clock())
            return None if held is None else held.owner

    def held(self, session_ids: list[str]) -> set[str]:
        """Which of these runs have a live lease."""
        with self._lock:
            now = self.clock()
            return {sid for sid in session_ids if self._live(sid, now) is not None}

    def expire(self, session_id: str) -> None:
        """Let one run's lease time out now, as if its holder stalled past the TTL."""
        with self._lock:
            self._leases.pop(session_id, None)

    def flush_all(self) -> None:
        """Forget every lease and fencing counter (Redis lost its data)."""
        with self._lock:
            self._leases.clear()
            self._counters.clear()

    def _live(self, session_id: str, now: datetime) -> _Held | None:
        held = self._leases.get(session_id)
        if held is not None and now > held.expires_at:  # Redis keeps a key up to its expiry instant
            del self._leases[session_id]
            return None
        return held

    def _next_token(self, session_id: str, floor: int, now: datetime) -> int:
        counter = self._counters.get(session_id)
        current = 0 if counter is None or now > counter.expires_at else counter.value
        token = max(current, floor) + 1
        self._counters[session_id] = _Counter(token, now + timedelta(milliseconds=keys.FENCE_EXPIRE_MS))
        return token
