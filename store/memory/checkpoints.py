"""The in-memory checkpoint store: ``PostgresCheckpointStore`` semantics over ``MemoryState``, for unit tests.

Every method is atomic under the state's lock; times come from the state's clock. Runs are created and
given input by ``store.memory.runs``, listed by ``store.memory.listing``.

Stays whole: the memory twin of ``store.checkpoints``, method for method, held to the same contract.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timedelta
from typing import Any

from store import errors, events, history, model_limit, payloads, records, runs
from store import listing as run_listing
from store.memory import approvals as approval_rows
from store.memory import listing
from store.memory import runs as run_rows
from store.memory.state import Clock, MemoryState, RunRow, SavedRow, refuse_nul, to_checkpoint, utc_now


def _inbox_entry(n: int, body: Any) -> records.InboxEntry:
    """An inbox body as stored in ``MemoryState.inbox`` (its messages, or them with their metadata)."""
    if isinstance(body, dict):
        return records.InboxEntry.from_stored(n, body["messages"], body["metadata"])
    return records.InboxEntry(n=n, messages=body)


class MemoryCheckpointStore:
    """``PostgresCheckpointStore`` semantics over dicts; ``state`` holds its tables (shared with approvals)."""

    def __init__(self, history_limit: int = 50, clock: Clock = utc_now) -> None:
        self.history_limit = history_limit
        self.state = MemoryState(clock=clock)

    # -- the step's hot path ---------------------------------------------------------------

    def close(self) -> None:
        """Nothing to give back in memory (``PostgresCheckpointStore.close`` returns a kept connection)."""

    def pinned(self) -> AbstractContextManager[None]:
        """Nothing to keep in memory (``PostgresCheckpointStore.pinned`` keeps one connection)."""
        return nullcontext()

    def claim(self, session_id: str, token: int, seq: int | None, *, again: bool = False) -> records.Claim:
        """Claim ``token`` as the run's fence and load the run (see ``PostgresCheckpointStore.claim``)."""
        state = self.state
        with state.lock:
            run = state.runs.get(session_id)
            if run is None:
                return records.Claim(None, stored_fence=None)
            if not (run.fence <= token if again else run.fence < token):
                return records.Claim(None, stored_fence=run.fence)
            if (seq is None or run.seq == seq) and runs.has_work(run):
                run.attempts += 1
            run.fence = token
            return records.Claim(
                to_checkpoint(session_id, run),
                inbox_head=run.inbox_head,
                now=state.clock(),
                abort_requested=run.abort_requested,
                lead_gone=run.parent_id is not None and run.parent_id not in state.runs,
            )

    def inbox(self, session_id: str, cursor: int) -> list[records.InboxEntry]:
        """Input sent after ``cursor``, in send order."""
        with self.state.lock:
            entries = sorted((n, body) for n, body in self.state.inbox.get(session_id, {}).items() if n > cursor)
        return [_inbox_entry(n, json.loads(body)) for n, body in entries]

    def record_step(self, write: records.StepWrite) -> datetime | None:
        """Write what a step did if its fence holds and its seq is the stored one plus one.

        The whole checkpoint is written, through ``save``: a unit test that wraps ``save`` on a store
        sees every write of its steps. Returns the save time, or None when refused.

        Raises:
            InputTooLargeError: the serialized checkpoint is over the size limit.
            StorageError: the document holds a NUL (as Postgres refuses it), or the history
                ring already has this seq (a primary-key violation in Postgres).
        """
        return self.save(
            write.checkpoint,
            drained_inbox=write.drained_inbox,
            approvals=write.approvals,
            drafts=write.events,
            settles_abort=write.settles_abort,
            paused_before=write.paused_before,
        )

    def save(
        self,
        checkpoint: records.Checkpoint,
        *,
        drained_inbox: bool = False,
        approvals: Sequence[records.Approval] = (),
        drafts: Sequence[records.EventDraft] = (),
        settles_abort: bool = False,
        paused_before: bool = False,
    ) -> datetime | None:
        """Write ``checkpoint`` as a step that does not say what it added, with the approvals it opened.

        ``paused_before``: as ``StepWrite.paused_before`` (a decision that continued the run meanwhile stands).

        Raises:
            InputTooLargeError: the serialized checkpoint is over the size limit.
            StorageError: the document holds a NUL, or the history ring already has this seq.
        """
        if self.history_limit > 0:
            checkpoint = checkpoint.model_copy(update={"history_seq": checkpoint.seq})
        document = checkpoint.document()
        body = payloads.dumps(document)
        if len(body) > payloads.MAX_CHECKPOINT:
            raise errors.InputTooLargeError(f"checkpoint of {len(body)} bytes is over the limit")
        refuse_nul(document)
        sid, seq, state = checkpoint.session_id, checkpoint.seq, self.state
        with state.lock:
            run = state.runs.get(sid)
            if run is None or run.fence != checkpoint.fence or run.seq != seq - 1:
                return None
            ring = state.history.setdefault(sid, {})
            if self.history_limit > 0 and seq in ring:
                raise errors.StorageError("database error: UniqueViolation")
            now = state.clock()
            continued = paused_before and checkpoint.status == "awaiting-approval" and run.status == "in-progress"
            run.status, run.seq = "in-progress" if continued else checkpoint.status, seq
            run.clear_failures()
            run.uncounted_usage = None
            run.inbox_cursor, run.document, run.updated_at = checkpoint.inbox_cursor, body, now
            run.aborted, run.end_due, run.waiting = checkpoint.aborted, checkpoint.end_due, checkpoint.waiting
            if settles_abort or checkpoint.status == "finished":
                run.abort_requested = False
            state.add_events(sid, run, drafts, now)
            if settles_abort:
                approval_rows.withdraw_for_run(state, sid, now)
            if self.history_limit > 0:
                ring[seq] = SavedRow(seq, checkpoint.fence, checkpoint.step, checkpoint.status, now, body)
                for old in [s for s in ring if s <= seq - self.history_limit]:
                    del ring[old]
            if drained_inbox:
                inbox = state.inbox.get(sid, {})
                for n in [n for n in inbox if n <= checkpoint.inbox_cursor]:
                    del inbox[n]
            approval_rows.insert(state, approvals, now)
            return now

    def note_usage(self, session_id: str, fence: int, usage: records.Usage) -> bool:
        """Keep a model call's usage before its turn is saved, so a crash in between still counts it."""
        record = usage.model_dump()
        payloads.dumps(record)
        with self.state.lock:
            run = self.state.runs.get(session_id)
            if run is None or run.fence != fence:
                return False
            run.uncounted_usage = record
            return True

    def note_wait(self, session_id: str, fence: int) -> bool:
        """Take back the attempt this step's claim counted: it waits on a model limit; False when fenced out."""
        with self.state.lock:
            run = self.state.runs.get(session_id)
            if run is None or run.fence != fence:
                return False
            run.attempts = max(run.attempts - 1, 0)
            return True

    def _failed(self, session_id: str, fence: int, error: records.LastError) -> RunRow | None:
        """The run with ``error`` recorded under its fence (call with the lock held); None if fenced out."""
        record = error.model_dump()
        payloads.dumps(record)
        refuse_nul(record)
        run = self.state.runs.get(session_id)
        if run is None or run.fence != fence:
            return None
        run.last_error, run.updated_at = record, self.state.clock()
        return run

    def record_failure(
        self, session_id: str, fence: int, error: records.LastError, drafts: Sequence[records.EventDraft] = ()
    ) -> int | None:
        """Store why a step failed (fenced), with its events; returns the attempts count, None if fenced out."""
        with self.state.lock:
            run = self._failed(session_id, fence, error)
            if run is None:
                return None
            run.next_attempt_at = None
            self.state.add_events(session_id, run, drafts, run.updated_at)
            return run.attempts

    def retry_later(
        self,
        session_id: str,
        fence: int,
        error: records.LastError,
        delay_s: float,
        drafts: Sequence[records.EventDraft] = (),
    ) -> int | None:
        """Record a transient failure and when to try again (see ``PostgresCheckpointStore.retry_later``)."""
        with self.state.lock:
            run = self._failed(session_id, fence, error)
            if run is None:
                return None
            self.state.add_events(session_id, run, drafts, run.updated_at)
            run.attempts, run.failures = 0, run.failures + 1
            run.retry_since = run.retry_since or run.updated_at
            run.next_attempt_at = run.updated_at + timedelta(seconds=max(delay_s, 0.0))
            return run.seq

    def refuse(
        self,
        session_id: str,
        fence: int,
        error: records.LastError,
        approval_ids: Sequence[str],
        drafts: Sequence[records.EventDraft] = (),
    ) -> bool:
        """Park the run with a non-retryable ``error``, leaving its checkpoint as it was.

        Decisions of ``approval_ids`` go back to pending and the run back to awaiting approval.
        """
        record = error.model_copy(update={"retryable": False}).model_dump()
        with self.state.lock:
            run = self.state.runs.get(session_id)
            if run is None or run.fence != fence:
                return False
            run.last_error, run.updated_at = record, self.state.clock()
            self.state.add_events(session_id, run, drafts, run.updated_at)
            if approval_ids:
                approval_rows.put_back(self.state, approval_ids)
                if run.status == "in-progress":
                    run.status = "awaiting-approval"
            return True

    def abort_requested(self, session_id: str) -> bool:
        """Whether an abort of the run waits for a step to settle it."""
        with self.state.lock:
            run = self.state.runs.get(session_id)
            return run is not None and run.abort_requested

    def decisions(self, approval_ids: Sequence[str]) -> dict[str, records.Approval]:
        """The approvals of a pause, by id (missing ids are left out)."""
        with self.state.lock:
            return approval_rows.by_ids(self.state, approval_ids)

    # -- producers -------------------------------------------------------------------------

    def append_input(
        self,
        session_id: str,
        agent: str,
        messages: Sequence[records.Message],
        idempotency_key: str | None = None,
        metadata: dict[str, Any] | None = None,
        business_state: Any = None,
        fairness_key: str | None = None,
    ) -> int:
        """Queue input for a run (creating the run) and return its per-run inbox number.

        ``metadata`` and ``business_state`` are kept with the input (see ``PostgresCheckpointStore.append_input``).

        Raises:
            SessionAwaitingApprovalError: the run waits on an approval.
            ConfigurationError: the session belongs to another agent, or ``metadata`` is not a JSON object.
            InputTooLargeError: ``metadata`` is over 16 KiB as JSON or too deep (nothing is written).
            CheckpointCorruptError: the stored run cannot be read.
            StorageError: the input holds a NUL (as Postgres refuses it).
        """
        metadata = runs.stored_metadata(
            runs.check_metadata(metadata),
            None if business_state is None else runs.check_business_state(business_state),
            None if fairness_key is None else model_limit.validate_fairness_key(fairness_key),
        )
        body = run_rows.dump_messages(messages)
        if metadata is not None:
            body = f'{{"messages":{body},"metadata":{payloads.dumps(metadata)}}}'
        refuse_nul([session_id, agent])
        with self.state.lock:
            return run_rows.queue_input(self.state, session_id, agent, body, idempotency_key)

    def create_run(self, checkpoint: records.Checkpoint, queued: Sequence[records.Message] = ()) -> bool:
        """Store a new run as ``checkpoint`` (a fork), with ``queued`` input; False if the id is taken."""
        document = checkpoint.model_copy(update={"history_seq": None}).document()
        body = payloads.dumps(document)
        queued_body = payloads.dumps([m.dump() for m in queued]) if queued else None
        refuse_nul([document, checkpoint.agent])
        with self.state.lock:
            return run_rows.create_from(self.state, checkpoint, body, queued_body)

    def reset_attempts(self, session_id: str, limits: dict[str, Any] | None = None) -> int | None:
        """Clear a parked run's error so it runs again (see ``PostgresCheckpointStore.reset_attempts``)."""
        with self.state.lock:
            run = self.state.runs.get(session_id)
            if run is None or not (
                runs.has_work(run)
                or (run.aborted and run.status == "in-progress")
                or (run.waiting and run.status == "in-progress" and not listing.children_moving(self.state, session_id))
            ):
                return None
            run.clear_failures()
            run.aborted = False
            if limits is not None:
                document = json.loads(run.document)
                document["limits"] = limits
                document["format"] = 3 if "messages_count" in document else 1
                run.document = payloads.dumps(document)
            return run.seq

    def start_children(
        self, lead: str, lead_agent: str, children: Sequence[tuple[str, str, str]], *, fence: int
    ) -> builtins.list[str]:
        """Create the child runs of ``lead`` that do not exist yet (see ``PostgresCheckpointStore.start_children``).

        Raises:
            FencedOutError: the lead is gone or its fence moved on (nothing is written).
        """
        refused: builtins.list[str] = []
        with self.state.lock:
            held = self.state.runs.get(lead)
            if held is None or held.fence != fence:
                raise errors.FencedOutError(lead, fence)
            for child_id, agent, prompt in children:
                child = self.state.runs.get(child_id)
                if child is not None:
                    if child.parent_id != lead:
                        refused.append(child_id)
                    continue
                run_rows.queue_input(
                    self.state,
                    child_id,
                    agent,
                    run_rows.dump_messages([records.Message(role="user", content=prompt)]),
                    None,
                )
                child = self.state.runs[child_id]
                child.parent_id = lead
                document = json.loads(child.document)
                child.document = payloads.dumps({**document, "lead_agent": lead_agent, "format": 3})
        return refused

    def waiting_leads(self, stale_after_s: float, limit: int = 500) -> builtins.list[records.DueRun]:
        """Leads waiting on children none of which can still move (see ``PostgresCheckpointStore.waiting_leads``)."""
        with self.state.lock:
            return listing.waiting_leads(self.state, stale_after_s, limit)

    def settle_end(self, session_id: str, fence: int, seq: int) -> bool:
        """Note that owed ``on_run_end`` hooks ran (see ``PostgresCheckpointStore.settle_end``)."""
        with self.state.lock:
            run = self.state.runs.get(session_id)
            if run is None or run.fence != fence or run.seq != seq or not run.end_due:
                return False
            run.end_due = False
            return True

    def request_abort(self, session_id: str) -> bool:
        """Ask for the run to stop (see ``PostgresCheckpointStore.request_abort``)."""
        with self.state.lock:
            run = self.state.runs.get(session_id)
            if run is None:
                raise errors.CheckpointNotFoundError(f"run {session_id!r} is not stored")
            prefix = session_id + records.CHILD_MARK
            for child_id, child in self.state.runs.items():
                if child_id.startswith(prefix) and child.status != "finished" and not child.aborted:
                    child.abort_requested = True
            if run.status == "finished" or run.aborted:
                return False
            run.abort_requested = True
            return True

    def read_events(self, session_id: str, after: int, limit: int = 500) -> builtins.list[events.Event]:
        """Durable events of the run with a seq above ``after``, oldest first."""
        with self.state.lock:
            found = [row for row in self.state.events.get(session_id, ()) if row[0] > after][:limit]
        return [
            events.Event(run_id=session_id, seq=seq, type=kind, at=at, data=events.with_message(kind, dict(data), None))
            for seq, kind, at, data in found
        ]

    def input_start(self, session_id: str, number: int) -> int | None:
        """The seq of the ``run.start`` that merged input ``number`` (None while it is not merged)."""
        with self.state.lock:
            starts = [
                row[0]
                for row in self.state.events.get(session_id, ())
                if row[1] == "run.start" and int(row[3].get("input_number", 0)) >= number
            ]
        return min(starts, default=None)

    def latest_start(self, session_id: str) -> int | None:
        """The seq of the run's latest ``run.start`` event, None when it has none."""
        with self.state.lock:
            starts = [row[0] for row in self.state.events.get(session_id, ()) if row[1] == "run.start"]
        return max(starts, default=None)

    # -- readers ---------------------------------------------------------------------------

    def load(self, session_id: str) -> records.Checkpoint | None:
        """The latest checkpoint of a run, or None.

        Raises:
            CheckpointCorruptError: the stored document does not parse as a checkpoint.
        """
        with self.state.lock:
            run = self.state.runs.get(session_id)
            return None if run is None else to_checkpoint(session_id, run)

    def progress(self, session_id: str) -> records.Progress | None:
        """A run's status, inbox cursor and last error, without its transcript; None if unknown."""
        with self.state.lock:
            run = self.state.runs.get(session_id)
            if run is None:
                return None
            error = None if run.last_error is None else records.LastError.model_validate(run.last_error)
            finish = json.loads(run.document).get("finish_reason") if run.document else None
            return records.Progress(
                status=run.status,
                inbox_cursor=run.inbox_cursor,
                inbox_head=run.inbox_head,
                last_error=error,
                aborted=run.aborted,
                events_next=run.events_next,
                finish_reason=finish,
                agent=run.agent,
            )

    def list(
        self,
        *,
        statuses: Iterable[str] | None = None,
        agent: str | None = None,
        limit: int = 1000,
        newest: bool = False,
    ) -> builtins.list[records.Checkpoint | records.PendingRun]:
        """Latest checkpoints by creation, optionally filtered; an unreadable one comes as a PendingRun."""
        with self.state.lock:
            return listing.latest(self.state, statuses, agent, limit, newest)

    def list_runs(
        self,
        *,
        agents: Iterable[str] | None = None,
        states: Iterable[str] | None = None,
        id_contains: str | None = None,
        since: datetime | None = None,
        limit: int = 50,
        cursor: str | None = None,
        details: bool = False,
    ) -> records.RunsPage:
        """A page of runs, newest first by creation (see ``PostgresCheckpointStore.list_runs``).

        Raises:
            ConfigurationError: a cursor no page gave, a limit out of range, an unknown state or a naive ``since``.
        """
        wanted = run_listing.RunFilter.of(agents, states, id_contains, since)
        position = None if cursor is None else run_listing.parse_cursor(cursor)
        with self.state.lock:
            return listing.runs_page(self.state, wanted, run_listing.check_limit(limit), position, details)

    def count_runs(
        self, *, agents: Iterable[str] | None = None, since: datetime | None = None
    ) -> dict[records.ListedState, int]:
        """How many runs stand in each state (see ``PostgresCheckpointStore.count_runs``)."""
        wanted = run_listing.RunFilter.of(agents, None, None, since)
        with self.state.lock:
            return listing.counts(self.state, wanted)

    def history(self, session_id: str, limit: int | None = None) -> builtins.list[records.HistoryEntry]:
        """Saved states of a run, newest first; ``[]`` for an unknown run."""
        with self.state.lock:
            saved = sorted(self.state.history.get(session_id, {}).values(), key=lambda s: s.seq, reverse=True)
            run = self.state.runs.get(session_id)
            agent = run.agent if run is not None else ""
        if limit is not None:
            saved = saved[:limit]
        return [
            history.entry(
                session_id,
                agent,
                json.loads(row.document),
                step=row.step,
                seq=row.seq,
                fence=row.fence,
                status=row.status,
                saved_at=row.saved_at,
            )
            for row in saved
        ]

    def stale_runs(self, stale_after_s: float, limit: int = 500) -> builtins.list[tuple[str, int]]:
        """Runs that should be moving and did not save for ``stale_after_s``: (session_id, seq)."""
        return [(run.session_id, run.seq) for run in self.due_runs(stale_after_s, limit)]

    def due_runs(
        self, stale_after_s: float, limit: int = 500, after: records.DueRun | None = None
    ) -> builtins.list[records.DueRun]:
        """Runs a step can move now, most overdue first (see ``PostgresCheckpointStore.due_runs``)."""
        with self.state.lock:
            return listing.due(self.state, stale_after_s, limit, after)

    def mark_swept(self, session_ids: Sequence[str]) -> None:
        """Note that the sweep just sent a step for these runs (see ``PostgresCheckpointStore.mark_swept``)."""
        with self.state.lock:
            now = self.state.clock()
            for session_id in session_ids:
                run = self.state.runs.get(session_id)
                if run is not None:
                    run.swept_at = now
                    if run.recovery is None:
                        run.recovery = {"seq": run.seq, "failures": run.failures}

    def settle_recoveries(self, agents: Sequence[str], limit: int = 500) -> builtins.list[records.SweptRun]:
        """The runs the sweep sent on that came out since, each once (see ``PostgresCheckpointStore``)."""
        found: builtins.list[records.SweptRun] = []
        with self.state.lock:
            for sid, run in sorted(self.state.runs.items()):
                if len(found) >= limit:
                    break
                if run.agent not in agents or not runs.recovery_settled(run):
                    continue
                run.recovery = None
                document = json.loads(run.document) if run.document else {}
                error = run.last_error
                found.append(
                    records.SweptRun(
                        session_id=sid,
                        agent=run.agent,
                        status=run.status,
                        finish_reason=document.get("finish_reason"),
                        aborted=run.aborted,
                        last_error=None
                        if error is None
                        else records.LastError(
                            code=str(error.get("code", "")),
                            message=str(error.get("message", "")),
                            retryable=error.get("retryable") is True,
                        ),
                    )
                )
        return found

    def expire_approvals(self, limit: int = 500) -> int:
        """Reject pending approvals past their ``expires_at`` (see ``PostgresCheckpointStore.expire_approvals``)."""
        with self.state.lock:
            return approval_rows.expire_due(self.state, self.state.clock(), limit)

    def pending(self, agent: str | None = None, limit: int = 1000) -> builtins.list[records.PendingRun]:
        """Runs that are not finished, oldest first (see ``PostgresCheckpointStore.pending``)."""
        with self.state.lock:
            return listing.pending(self.state, agent, limit)

    # -- maintenance -------------------------------------------------------------------------

    def delete(self, session_id: str, *, keep_history: bool = False) -> bool:
        """Drop a run's checkpoint and inbox (and its history unless ``keep_history``), its child runs with it."""
        state = self.state
        prefix = session_id + records.CHILD_MARK
        with state.lock:  # one hold, as Postgres lists the runs under the run only once it holds the run's row
            deleted = False
            for run_id in [*(child for child in state.runs if child.startswith(prefix)), session_id]:
                deleted = state.runs.pop(run_id, None) is not None
                approval_rows.withdraw_for_run(state, run_id, state.clock())
                state.inbox.pop(run_id, None)
                state.events.pop(run_id, None)
                for key in [k for k in state.sends if k[0] == run_id]:
                    del state.sends[key]
                if not keep_history:
                    state.history.pop(run_id, None)
            return deleted

    def prune(self, older_than: datetime) -> int:
        """Drop finished runs last saved before ``older_than`` and history entries older than it.

        Raises:
            ConfigurationError: ``older_than`` is a naive datetime.
        """
        if older_than.tzinfo is None:
            raise errors.ConfigurationError("prune needs a timezone-aware cutoff")
        state = self.state
        with state.lock:
            doomed = [
                sid
                for sid, run in state.runs.items()
                if run.status == "finished" and run.inbox_head <= run.inbox_cursor and run.updated_at < older_than
            ]
            for sid in doomed:
                del state.runs[sid]
                state.events.pop(sid, None)
            for ring in state.history.values():
                for seq in [seq for seq, row in ring.items() if row.saved_at < older_than]:
                    del ring[seq]
            return len(doomed)

    def register_agents(self, fingerprints: dict[str, dict[str, Any]]) -> None:
        """Record the agents a worker serves, so producers can refuse unknown names."""
        with self.state.lock:
            self.state.agents.update(fingerprints)

    def known_agents(self) -> builtins.list[str]:
        """Names of agents some worker registered."""
        with self.state.lock:
            return sorted(self.state.agents)

    # -- test hooks --------------------------------------------------------------------------

    def approvals_of(self, session_id: str) -> builtins.list[records.Approval]:
        """Approval rows created by the saves of a run, oldest first."""
        with self.state.lock:
            return [a for a in self.state.approvals.values() if a.session_id == session_id]

    def overwrite_document(self, session_id: str, document: Any) -> None:
        """Replace a run's stored document verbatim (to simulate corruption in tests)."""
        with self.state.lock:
            self.state.runs[session_id].document = json.dumps(document)
