"""The Postgres checkpoint store: claim-and-load, a step's fenced write with history, inbox, listing, pruning.

It implements ``store.interfaces.CheckpointStore``; runs are created and given input by ``store.runs``. Every
statement on the step's hot path is one round trip of plain SQL (``text()``, compiled once). Times come from
Postgres ``now()``, never from worker clocks. It stays whole: every statement a step or the sweep makes on a
run's control columns (fence, seq, attempts, retry times) is here; new input, which also clears them, is in
``store.runs``.

Stays whole: the Postgres checkpoint store implements one port, and its statements share CTE fragments.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, TextClause, text
from sqlalchemy.engine import Row

from store import approvals as approval_rows
from store import errors, event_log, events, history, listing, payloads, records, registry, runs, transcripts
from store.database import Direct, Transaction, driver_sql
from store.records import Claim

__all__ = ["PostgresCheckpointStore"]

_COLUMNS = runs.COLUMNS


def _rows_from(first_slot: str) -> str:
    """SQL: the run's message rows from ``first_slot`` on, as a JSON array of ``[slot, message]`` in slot order."""
    return (
        "(SELECT jsonb_agg(jsonb_build_array(m.slot, m.message) ORDER BY m.slot) FROM run_messages m"
        f" WHERE m.session_id = :sid AND m.slot >= {first_slot})"
    )


#: The rows a process has not seen: from the first slot that may have changed since (``:from``) while the
#: transcript is the one it remembers (``:known``), else all of them.
_TAIL_ROWS = (
    _rows_from("CASE WHEN transcript_id = CAST(:known AS bigint) THEN CAST(:from AS int) ELSE 0 END") + " AS tail"
)


def _claim_sql(fenced: str) -> TextClause:
    """Claim the fencing token and load the run in one statement, where the stored fence is ``fenced`` the token.

    A start counts as an attempt only when the step will do work (matching seq, and a run that is in progress
    or has new input). The run's news of its children (``lead_news``) is copied as of the claim: its save marks
    that much seen.
    """
    return text(f"""
UPDATE runs SET fence = :token,
  news_claimed = COALESCE((SELECT n.n FROM lead_news n WHERE n.lead_id = :sid), news_claimed),
  attempts = attempts + CASE WHEN (CAST(:seq AS bigint) IS NULL OR seq = CAST(:seq AS bigint))
    AND {runs.HAS_WORK} THEN 1 ELSE 0 END
WHERE session_id = :sid AND fence {fenced} :token
RETURNING {_COLUMNS}, now() AS db_now, abort_requested IS NOT NULL AS abort_pending, {_TAIL_ROWS},
  CASE WHEN parent_id IS NULL THEN false
       ELSE NOT EXISTS (SELECT 1 FROM runs l WHERE l.session_id = runs.parent_id) END AS lead_gone
""")


_CLAIM = _claim_sql("<")
#: The holder of a token claims its run again for the next step it chains: the fence may be its own token already
#: (tokens are unique to one acquisition of the lease, so an equal fence means nobody claimed the run since).
_CLAIM_AGAIN = _claim_sql("<=")
_FENCE_OF = text("SELECT fence FROM runs WHERE session_id = :sid")
_TAIL = text(f"SELECT {_TAIL_ROWS} FROM runs WHERE session_id = :sid")
_LOAD = text(f"SELECT {_COLUMNS}, {runs.MESSAGES} FROM runs WHERE session_id = :sid")
_STORED = text(
    f"SELECT transcript_id, seq, jsonb_exists(document, 'messages_count') AS new_format,"
    f" {_rows_from('0')} AS rows FROM runs WHERE session_id = :sid"
)
_PROGRESS = text(
    "SELECT status, inbox_cursor, inbox_head, last_error, aborted, events_next,"
    " document ->> 'finish_reason'"
    " AS finish_reason, agent FROM runs WHERE session_id = :sid"
)
_INBOX = text("SELECT n, messages, metadata FROM inbox WHERE session_id = :sid AND n > :cursor ORDER BY n")

# A child ``c`` that settled for its lead's sweep: finished, stopped by an abort, or parked (not by a refusal).
_SETTLED_CHILD = (
    f"(c.status = 'finished' OR c.aborted OR (NOT {runs.not_parked_sql('c')} AND NOT {runs.refused_sql('c')}))"
)


def _waited_sql(document: str) -> str:
    """SQL: the ids of the children a lead's ``document`` waits on (its delegated calls', else its background)."""
    return f"""
  SELECT d.value FROM jsonb_each_text(CASE WHEN jsonb_typeof({document} -> 'delegated') = 'object'
                                      THEN {document} -> 'delegated' ELSE '{{}}' END) d
  UNION ALL
  SELECT b.value FROM jsonb_array_elements_text(
    CASE WHEN jsonb_typeof({document} -> 'delegated') IS DISTINCT FROM 'object'
           AND jsonb_typeof({document} -> 'background') = 'array'
         THEN {document} -> 'background' ELSE '[]' END) b"""


# What a lead's save makes of its children's news (``lead_news``, migration 0022). Saved waiting, the news its claim
# found is seen (what came after may have missed the step's reads of its children, and stays unseen), unless the
# save leaves it waiting with no child at all or on a child that already settled (a step may save from what it
# read before, or without reading): that is news now, for the sweep to wake it. Saved not waiting, the row goes
# (the lead's next step reads its children anew). After ``saved``: a ``lead_news`` row is always taken after the
# ``runs`` rows of its statement.
_SAVE_NEWS = f"""
seen AS (
  INSERT INTO lead_news AS ln (lead_id, n, seen)
  SELECT :sid, CASE WHEN NOT EXISTS (SELECT 1 FROM runs c WHERE c.parent_id = :sid)
                      OR EXISTS (SELECT 1 FROM runs c WHERE c.parent_id = :sid AND {_SETTLED_CHILD}
                                 AND c.session_id IN ({_waited_sql("(SELECT body FROM doc)")}))
                    THEN nextval('lead_news_ids') ELSE 0 END, s.news_claimed
  FROM saved s WHERE :waiting
  ON CONFLICT (lead_id) DO UPDATE SET n = GREATEST(ln.n, EXCLUDED.n), seen = EXCLUDED.seen
),
unwaited AS (DELETE FROM lead_news WHERE lead_id = :sid AND NOT :waiting AND EXISTS (SELECT 1 FROM saved))"""

# The fenced write of a step: the run's control columns and document, the messages it added (rows past the
# stored ones; a rewrite also replaces and drops rows and renews the transcript id), the history entry (the
# same document: it points at the rows by seq), the ring trim and the inbox trim, in one statement.
_SAVE_HEAD = f"""
WITH doc AS (SELECT CAST(:doc AS jsonb) AS body),
saved AS (
  UPDATE runs SET status = CASE WHEN CAST(:paused_before AS boolean) AND runs.status = 'in-progress'
      AND CAST(:status AS text) = 'awaiting-approval' THEN 'in-progress' ELSE :status END,
    seq = :seq, attempts = 0, last_error = NULL, uncounted_usage = NULL,
    next_attempt_at = NULL, retry_since = NULL, failures = 0,
    inbox_cursor = :cursor, document = (SELECT body FROM doc), updated_at = now(),
    transcript_id = CASE WHEN :rewrites THEN nextval('run_transcript_ids') ELSE transcript_id END,
    aborted = :aborted, abort_requested = CASE WHEN :clear_abort THEN NULL ELSE abort_requested END,
    end_due = :end_due, waiting = :waiting, events_next = events_next + :n_events
  WHERE session_id = :sid AND fence = :fence AND seq = :seq - 1
  RETURNING session_id, updated_at, transcript_id, events_next, news_claimed
),
added AS ({runs.ADD_MESSAGES.strip()} WHERE EXISTS (SELECT 1 FROM saved)
  ON CONFLICT (session_id, slot) DO UPDATE SET message = EXCLUDED.message, seq = EXCLUDED.seq
),{_SAVE_NEWS}"""
_SAVE_GONE = """,
gone AS (
  DELETE FROM run_messages WHERE session_id = :sid AND slot = ANY(CAST(:gone AS int[])) AND EXISTS (SELECT 1 FROM saved)
)"""
_SAVE_INBOX = """,
drained AS (
  DELETE FROM inbox WHERE session_id = :sid AND n <= :cursor AND EXISTS (SELECT 1 FROM saved)
)"""
_SAVE_TAIL = "\nSELECT updated_at, transcript_id FROM saved"
_SAVES = {
    (keeps, inbox, gone, evented): text(
        _SAVE_HEAD
        + (_SAVE_GONE if gone else "")
        + (history.SAVE_ENTRY if keeps else "")
        + (_SAVE_INBOX if inbox else "")
        + (event_log.SAVE_EVENTS if evented else "")
        + _SAVE_TAIL
    )
    for keeps in (True, False)
    for inbox in (True, False)
    for gone in (True, False)
    for evented in (True, False)
}

# Failures write their events (``error``, ``provider.retry``, ``run.done``) in the same statement.
_FAIL = text(f"""
WITH saved AS (
  UPDATE runs SET last_error = CAST(:error AS jsonb), updated_at = now(), next_attempt_at = NULL,
    events_next = events_next + :n_events
  WHERE session_id = :sid AND fence = :fence RETURNING attempts, events_next, updated_at
){event_log.SAVE_EVENTS}
SELECT attempts FROM saved
""")
# A failure the step itself recorded is not a crash: the crash-loop count starts again, and the retry
# budget counts from the first failure of the streak.
_RETRY_LATER = text(f"""
WITH saved AS (
  UPDATE runs SET last_error = CAST(:error AS jsonb), updated_at = now(), attempts = 0, failures = failures + 1,
    retry_since = COALESCE(retry_since, now()), next_attempt_at = now() + make_interval(secs => :delay),
    events_next = events_next + :n_events
  WHERE session_id = :sid AND fence = :fence RETURNING seq, events_next, updated_at
){event_log.SAVE_EVENTS}
SELECT seq FROM saved
""")
# A step that waits on a model limit did no work: its start does not count toward the crash-loop guard.
_NOTE_WAIT = text(
    "UPDATE runs SET attempts = GREATEST(attempts - 1, 0) WHERE session_id = :sid AND fence = :fence RETURNING 1"
)
_NOTE_USAGE = text(
    "UPDATE runs SET uncounted_usage = CAST(:usage AS jsonb) WHERE session_id = :sid AND fence = :fence RETURNING 1"
)
# A resume is a person acting on the run: a run stopped by an abort or a budget moves again, under the limits given,
# and so does a run waiting on children none of which can still move (settled, paused or gone: no wake-up comes).
_RESET_ATTEMPTS = text(f"""
UPDATE runs SET attempts = 0, last_error = NULL, failures = 0, retry_since = NULL, next_attempt_at = NULL,
  aborted = false,
  document = CASE WHEN CAST(:limits AS jsonb) IS NULL THEN document
    ELSE document || jsonb_build_object('limits', CAST(:limits AS jsonb),
                                       'format', CASE WHEN document ? 'messages_count' THEN 3 ELSE 1 END) END
WHERE session_id = :sid AND ({runs.HAS_WORK} OR (aborted AND status = 'in-progress')
  OR (waiting AND status = 'in-progress' AND NOT EXISTS (
        SELECT 1 FROM runs c WHERE c.parent_id = runs.session_id
          AND {runs.has_work_sql("c")} AND {runs.not_parked_sql("c")})))
RETURNING seq
""")
# An abort of an unfinished run: kept until a step settles it (a paused run's approvals are withdrawn then).
_REQUEST_ABORT = text("""
UPDATE runs SET abort_requested = COALESCE(abort_requested, now())
WHERE (session_id = :sid OR left(session_id, :prefix_len) = :prefix) AND status <> 'finished' AND NOT aborted
RETURNING session_id
""")
_HOLD_FOR_ABORT = text("SELECT 1 FROM runs WHERE session_id = :sid FOR NO KEY UPDATE")
_EXISTS = text("SELECT 1 FROM runs WHERE session_id = :sid")
# Leads whose wake-up was lost: waiting, silent for ``stale`` seconds, no child that can still move, and a child
# that changed since the lead's last save (a lead paused on a child's approval is not woken again and again), a
# child it waits on that settled (it may have settled before the lead's last save, while the lead's step held the
# lease its wake-up met), or no child left at all (deleted: nothing else would wake it). The children a lead waits
# on are its delegated calls' or, once it answered with background tasks still running, those tasks. A child refused
# to resume (its agent changed) counts for none of these: the lead waits on it as on a person.
# Only leads with news of a child since their step's claim are read (``lead_news``, migration 0022): each of these
# conditions follows from a child's change that came after it, so a lead without news meets none of them, and a
# pass reads the leads with news, however many wait.
# Each lead with news is looked up by id (a lateral subquery with a LIMIT is never turned into a join: a generic
# plan of a prepared statement could otherwise read every waiting lead first).
_WAITING_LEADS = text(f"""
SELECT w.session_id, w.seq, w.agent FROM lead_news n CROSS JOIN LATERAL (
SELECT l.session_id, l.seq, l.agent, l.updated_at FROM runs l
WHERE l.session_id = n.lead_id AND l.waiting AND l.updated_at < now() - make_interval(secs => :stale)
  AND (l.swept_at IS NULL OR l.swept_at < now() - make_interval(secs => :stale))
  AND NOT EXISTS (SELECT 1 FROM runs c WHERE c.parent_id = l.session_id
                  AND {runs.has_work_sql("c")} AND {runs.not_parked_sql("c")})
  AND (EXISTS (SELECT 1 FROM runs c WHERE c.parent_id = l.session_id AND c.updated_at > l.updated_at
               AND NOT {runs.refused_sql("c")})
       OR NOT EXISTS (SELECT 1 FROM runs c WHERE c.parent_id = l.session_id)
       OR EXISTS (SELECT 1 FROM runs c WHERE c.parent_id = l.session_id AND {_SETTLED_CHILD}
                  AND c.session_id IN ({_waited_sql("l.document")})))
LIMIT 1) w
WHERE n.n > n.seen
ORDER BY w.updated_at LIMIT :limit
""")
# News no sweep needs: of leads gone, and of leads that stopped (finished or aborted) without waiting, which move
# again only through a step whose claim copies the news anew.
_NEWS_DROPPED = text("""
DELETE FROM lead_news n WHERE n.n > n.seen AND NOT EXISTS (
  SELECT 1 FROM runs l WHERE l.session_id = n.lead_id AND (l.waiting OR (l.status <> 'finished' AND NOT l.aborted))
  LIMIT 1)
""")
_SET_PARENT = text("""
UPDATE runs SET parent_id = :lead,
  document = document || jsonb_build_object('lead_agent', CAST(:lead_agent AS text), 'format', 3)
WHERE session_id = ANY(:ids) AND parent_id IS NULL
""")
# The lead's row, held against a delete (which takes it FOR UPDATE) until its children are written, with its fence.
_HOLD_LEAD = text("SELECT fence FROM runs WHERE session_id = :lead FOR KEY SHARE")
# Ids among a step's children that name a run which is not that lead's child.
_NOT_ITS_OWN = text("SELECT session_id FROM runs WHERE session_id = ANY(:ids) AND parent_id IS DISTINCT FROM :lead")
# A delete holds the run's row, then the rows of the runs under it (by id, deepest first is the order of deletion).
_HOLD_RUN = text("SELECT 1 FROM runs WHERE session_id = :sid FOR UPDATE")
_UNDER = text("SELECT session_id FROM runs WHERE left(session_id, :n) = :prefix ORDER BY session_id FOR UPDATE")
_END_SETTLED = text(
    "UPDATE runs SET end_due = false WHERE session_id = :sid AND fence = :fence AND seq = :seq AND end_due RETURNING 1"
)
_ABORT_PENDING = text("SELECT abort_requested IS NOT NULL AS pending FROM runs WHERE session_id = :sid")
# Runs a step can move: not paused, not parked, and either silent for ``stale`` seconds with no retry time, or
# due for a retry (``due`` is the last save or the retry time). Each kind is one range of its own partial index
# (migration 0021), read in (due, session_id) order and merged: parked runs, runs saved within ``stale`` and
# retries still ahead are never read, so a pass costs the same however many runs are stored. Filtered before the
# LIMIT, so runs that cannot move never crowd out those that can; paged by (due, session_id) so a page full of
# live leases does not hide the rest.
_NOT_SWEPT = "(swept_at IS NULL OR swept_at < now() - make_interval(secs => :stale))"
_DUE = text(f"""
SELECT session_id, seq, agent, retrying, due FROM (
  (SELECT session_id, seq, agent, false AS retrying, updated_at AS due FROM runs
   WHERE {runs.HAS_WORK} AND {runs.NOT_PARKED} AND next_attempt_at IS NULL
     AND updated_at < now() - make_interval(secs => :stale) AND {_NOT_SWEPT}
     AND (updated_at, session_id) > (:after_due, :after_sid)
   ORDER BY updated_at, session_id LIMIT :limit)
  UNION ALL
  (SELECT session_id, seq, agent, true AS retrying, next_attempt_at AS due FROM runs
   WHERE {runs.HAS_WORK} AND {runs.NOT_PARKED} AND next_attempt_at IS NOT NULL
     AND next_attempt_at <= now() AND {_NOT_SWEPT}
     AND (next_attempt_at, session_id) > (:after_due, :after_sid)
   ORDER BY next_attempt_at, session_id LIMIT :limit)
) due ORDER BY due, session_id LIMIT :limit
""")
_PRUNE_RUNS = """
WITH pruned AS (
  DELETE FROM runs WHERE status = 'finished' AND inbox_head <= inbox_cursor AND updated_at < :cutoff
  RETURNING session_id
),
messages AS (DELETE FROM run_messages WHERE session_id IN (SELECT session_id FROM pruned)),
run_events AS (DELETE FROM run_events WHERE session_id IN (SELECT session_id FROM pruned))
SELECT session_id FROM pruned
"""
_MARK_SWEPT = text(f"UPDATE runs SET swept_at = now(), recovery = {runs.RECOVERY_MARK} WHERE session_id = ANY(:ids)")
# Claims the recoveries that came out, at most once: a second sweep skips the rows the first holds, and finds their
# mark gone once it committed.
_SETTLE_RECOVERIES = text(f"""
UPDATE runs SET recovery = NULL
WHERE session_id IN (
  SELECT session_id FROM runs
  WHERE recovery IS NOT NULL AND agent = ANY(:agents) AND {runs.RECOVERY_SETTLED}
  ORDER BY session_id LIMIT :limit FOR UPDATE SKIP LOCKED)
RETURNING session_id, agent, status, aborted, last_error, document ->> 'finish_reason' AS finish_reason
""")
# With the kind of the approval a paused run waits on first (a tool call or a question).
_PENDING = (
    f"SELECT {_COLUMNS}, (SELECT a.kind FROM approvals a"
    " WHERE a.approval_id = runs.document -> 'approval_ids' ->> 0) AS approval_kind,"
    f" status = 'awaiting-approval' AND waiting AND NOT {listing.OWN_APPROVALS_PER_ROW} AS children_only"
    f" FROM runs WHERE (status = 'awaiting-approval' OR aborted OR waiting OR {runs.HAS_WORK})"
)
_EARLIEST = datetime(1, 1, 1, tzinfo=UTC)
#: The hot path's statements in the driver's parameter style (run on ``store.database.direct`` connections).
_DIRECT = {
    statement: driver_sql(statement)
    for statement in (
        _CLAIM,
        _CLAIM_AGAIN,
        _FENCE_OF,
        _TAIL,
        _STORED,
        _INBOX,
        _NOTE_USAGE,
        _NOTE_WAIT,
        _FAIL,
        _RETRY_LATER,
        _ABORT_PENDING,
        *_SAVES.values(),
    )
}
#: Stands for a leftover row of a deleted run: equal to no message a step writes, so the row is replaced.
_LEFTOVER = records.Message.model_construct(role="system", content={"leftover": True})


def _size(message: Any) -> int:
    """Bytes of a stored message as JSON (what the checkpoint size limit counts)."""
    return len(payloads.dumps(message).encode("utf-8"))


def _format_1(transcript_id: int, seq: int, rows: Iterable[Any]) -> transcripts.Known:
    """What is stored of a format-1 run's transcript as rows: nothing, or a deleted run's leftovers.

    Leftover rows (``[slot, message]``) are replaced or dropped by the run's first save, which writes its
    whole transcript as rows.
    """
    leftovers = [int(slot) for slot, _ in rows]
    return transcripts.Known(
        transcript_id=transcript_id,
        seq=seq,
        messages=[_LEFTOVER] * len(leftovers),
        slots=leftovers,
        sizes=[0] * len(leftovers),
    )


def _slot_finder(rows: transcripts.Rows) -> Callable[[records.Message], int | None]:
    """Finds the slot a save writes a message to: the same object first, else an equal one."""
    by_identity = {id(message): slot for slot, message, _ in rows.added}

    def slot_of(message: records.Message) -> int | None:
        slot = by_identity.get(id(message))
        if slot is None:
            slot = next((s for s, added, _ in rows.added if added == message), None)
        return slot

    return slot_of


def _pending(row: Row[Any]) -> records.PendingRun:
    """A listed run as a ``PendingRun``; an unreadable checkpoint is listed parked as corrupt."""
    try:
        checkpoint = runs.row_checkpoint(row, row.session_id)
    except (errors.CheckpointCorruptError, errors.CheckpointFormatError) as exc:
        return records.unreadable_run(row.session_id, row.agent, row.status, row.attempts, exc, row.next_attempt_at)
    return records.pending_run(
        checkpoint, row.approval_kind, queued=row.inbox_head > row.inbox_cursor, own_approvals=not row.children_only
    )


def _swept(row: Any) -> records.SweptRun:
    """A settled recovery's row as a ``SweptRun``."""
    stored = row.last_error if isinstance(row.last_error, dict) else None
    # Only the fields a LastError has: a row written by another release may carry more.
    error = (
        None
        if stored is None
        else records.LastError(
            code=str(stored.get("code", "")),
            message=str(stored.get("message", "")),
            retryable=stored.get("retryable") is True,
        )
    )
    return records.SweptRun(
        session_id=row.session_id,
        agent=row.agent,
        status=row.status,
        finish_reason=row.finish_reason,
        aborted=bool(row.aborted),
        last_error=error,
    )


def _delete_run(conn: Connection, session_id: str, keep_history: bool) -> int:
    """Delete one run and every row kept under its id, in the caller's transaction; 1 if the run was stored."""
    # The run row first, then its approvals: the order approvals.resolve takes them in.
    deleted = int(conn.execute(text("DELETE FROM runs WHERE session_id = :sid"), {"sid": session_id}).rowcount)
    approval_rows.withdraw_for_run(conn, session_id)
    conn.execute(text("DELETE FROM inbox WHERE session_id = :sid"), {"sid": session_id})
    conn.execute(text("DELETE FROM sends WHERE session_id = :sid"), {"sid": session_id})
    if keep_history:
        # Kept entries must outlive the message rows they point at: they take their transcripts along.
        history.make_standalone(conn, session_id)
    else:
        conn.execute(text("DELETE FROM checkpoint_history WHERE session_id = :sid"), {"sid": session_id})
    conn.execute(text("DELETE FROM run_messages WHERE session_id = :sid"), {"sid": session_id})
    conn.execute(event_log.DELETE, {"sid": session_id})
    return deleted


class PostgresCheckpointStore:
    """Checkpoints, history and inbox of runs in Postgres."""

    def __init__(
        self, engine: Engine, history_limit: int = 50, *, events: bool = True, keep_connection: bool = False
    ) -> None:
        self.engine = engine
        self.history_limit = history_limit
        #: Whether saves write the run's durable events (off only to measure what they cost).
        self.events = events
        # One-statement writes are atomic alone: autocommit saves the BEGIN and COMMIT round trips.
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._transcripts = transcripts.Transcripts()
        #: ``keep_connection``: a worker process's steps keep their pinned connection from one step to the next.
        self._direct = Direct(engine, keep=keep_connection)

    # -- the step's hot path ---------------------------------------------------------------

    def close(self) -> None:
        """Give back the connection a worker's steps keep (``keep_connection``); the store stays usable."""
        self._direct.release_kept()

    def pinned(self) -> AbstractContextManager[None]:
        """One pooled connection for this thread's calls until the block ends: a step's claim, reads and saves."""
        return self._direct.pinned()

    def claim(self, session_id: str, token: int, seq: int | None, *, again: bool = False) -> Claim:
        """Claim ``token`` as the run's fence and load the run, in one statement.

        ``again``: the holder of ``token`` claims the run for the next step it chains (its own token may be the
        stored fence already).

        Of the transcript only the rows past what this process remembers of the run are read (all of
        them when it remembers nothing, or the run's transcript was rewritten since).

        Returns a ``Claim`` without checkpoint when the run is unknown (``stored_fence`` None)
        or when the stored fence is not below ``token`` (a Redis counter that was lost).
        """
        known = self._transcripts.get(session_id)
        params = {
            "sid": session_id,
            "token": token,
            "seq": seq,
            "known": known.transcript_id if known else None,
            "from": known.stable if known else 0,
        }
        with self._direct.connection() as conn:
            row = conn.execute(_DIRECT[_CLAIM_AGAIN if again else _CLAIM], params).fetchone()
            if row is None:
                stored = conn.execute(_DIRECT[_FENCE_OF], {"sid": session_id}).fetchone()
                return Claim(None, stored_fence=None if stored is None else int(stored["fence"]))
        try:
            messages = self._messages_of(session_id, row, known)
        except errors.CheckpointCorruptError:
            # A claim that waited for the previous holder's save sees its row but not the message rows that
            # save wrote (they were not in the statement's snapshot). The fence is ours now, so no save can
            # come between: read the rows again in a statement of its own before calling the run corrupt.
            with self._direct.connection() as conn:
                reread = conn.execute(_DIRECT[_TAIL], {key: params[key] for key in ("sid", "known", "from")}).fetchone()
            messages = self._messages_of(session_id, {**row, "tail": reread["tail"] if reread else None}, known)
        checkpoint = runs.row_checkpoint(row, session_id, messages)
        return Claim(
            checkpoint,
            inbox_head=int(row["inbox_head"]),
            now=row["db_now"],
            abort_requested=bool(row["abort_pending"]),
            lead_gone=bool(row["lead_gone"]),
        )

    def _messages_of(self, session_id: str, row: Any, known: transcripts.Known | None) -> list[records.Message] | None:
        """The transcript of a claimed row (None for a format-1 document, which holds its own)."""
        document = row["document"] or {}
        if "messages_count" not in document:
            # Format 1 (a run of an earlier release): the document holds the transcript. Its first save reads
            # the rows first (``_stored``): ``lousho storage upgrade`` may write them meanwhile.
            self._transcripts.forget(session_id)
            return None
        tail = [(slot, body, _size(body)) for slot, body in row["tail"] or ()]
        transcript_id, seq = int(row["transcript_id"]), int(row["seq"])
        try:
            if known is not None and known.transcript_id == transcript_id:
                found = transcripts.extend(known, transcript_id, seq, tail)
            else:
                found = transcripts.from_rows(transcript_id, seq, tail)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise errors.CheckpointCorruptError(f"messages of run {session_id!r} cannot be read") from exc
        if len(found.messages) != document["messages_count"]:
            raise errors.CheckpointCorruptError(
                f"run {session_id!r} has {len(found.messages)} stored messages, its document says"
                f" {document.get('messages_count')}"
            )
        self._transcripts.remember(session_id, found)
        return found.messages

    def inbox(self, session_id: str, cursor: int) -> list[records.InboxEntry]:
        """Input sent after ``cursor``, in send order."""
        with self._direct.connection() as conn:
            rows = conn.execute(_DIRECT[_INBOX], {"sid": session_id, "cursor": cursor}).fetchall()
        return [records.InboxEntry.from_stored(row["n"], row["messages"], row["metadata"]) for row in rows]

    def record_step(self, write: records.StepWrite) -> datetime | None:
        """Write what a step did (its checkpoint's ``seq`` must be the stored one plus one) if its fence still holds.

        Only the messages the step added are written, as rows (compared with what this process read of
        the run: a write without a claim before it reads the stored rows first); the document, the
        history entry, the ring trim and the inbox trim go in the same statement, the approvals the step
        opened in the same transaction. Returns the save time, or None when the fence or seq no longer
        matched (another holder took over).

        Raises:
            InputTooLargeError: the serialized checkpoint is over the size limit.
        """
        checkpoint, approvals = write.checkpoint, write.approvals
        sid, seq = checkpoint.session_id, checkpoint.seq
        keeps_history = self.history_limit > 0
        if keeps_history:
            checkpoint = checkpoint.model_copy(update={"history_seq": seq})
        known = self._stored(sid, seq - 1)
        rows = transcripts.diff(known, checkpoint.messages)
        document = runs.format_document(checkpoint, len(checkpoint.messages))
        if len(document) + rows.total_bytes > payloads.MAX_CHECKPOINT:
            raise errors.InputTooLargeError(f"checkpoint of {len(document) + rows.total_bytes} bytes is over the limit")
        drafts = write.events if self.events else ()
        params = {
            "sid": sid,
            "doc": document,
            "status": checkpoint.status,
            "seq": seq,
            "fence": checkpoint.fence,
            "cursor": checkpoint.inbox_cursor,
            "step": checkpoint.step,
            "keep": self.history_limit,
            "rows": rows.body,
            "rewrites": rows.rewrites,
            "gone": rows.gone,
            "aborted": checkpoint.aborted,
            "end_due": checkpoint.end_due,
            "waiting": checkpoint.waiting,
            "clear_abort": write.settles_abort or checkpoint.status == "finished",
            "paused_before": write.paused_before,
            "n_events": len(drafts),
            "events": events.encode(drafts, _slot_finder(rows)) if drafts else "[]",
        }
        statement = _SAVES[(keeps_history, write.drained_inbox, bool(rows.gone), bool(drafts))]
        if approvals or rows.rewrites or write.settles_abort:
            saved = self._save_in_transaction(
                statement, params, approvals, rows.rewrites and keeps_history, withdraw=write.settles_abort
            )
        else:
            with self._direct.connection() as conn:
                saved = conn.execute(_DIRECT[statement], params).fetchone()
        if saved is None:
            self._transcripts.forget(sid)
            return None
        if checkpoint.status == "in-progress":
            self._transcripts.remember(
                sid, transcripts.after_save(known, rows, seq, list(checkpoint.messages), int(saved["transcript_id"]))
            )
        else:
            self._transcripts.forget(sid)  # finished or paused: not stepped again soon
        updated_at: datetime = saved["updated_at"]
        return updated_at

    def _save_in_transaction(
        self,
        statement: TextClause,
        params: dict[str, Any],
        approvals: Sequence[records.Approval],
        standalone: bool,
        withdraw: bool = False,
    ) -> dict[str, Any] | None:
        """A save that opens or withdraws approvals or replaces stored messages: one transaction."""
        with self._begin() as conn:
            if standalone:
                # Stored messages change (never in a step): kept entries take their transcripts along first.
                history.make_standalone(conn, params["sid"])
            saved = conn.execute(statement, params).first()
            if saved is not None and approvals:
                approval_rows.insert(conn, approvals)
            if saved is not None and withdraw:
                approval_rows.withdraw_for_run(conn, params["sid"])  # an abort: the pause's decisions are void
        return None if saved is None else dict(saved._mapping)

    def _stored(self, session_id: str, seq: int) -> transcripts.Known:
        """What is stored of the run's transcript as of save ``seq``: remembered, or read now."""
        known = self._transcripts.get(session_id)
        if known is not None and known.seq == seq:
            return known
        with self._direct.connection() as conn:
            row = conn.execute(_DIRECT[_STORED], {"sid": session_id}).fetchone()
        if row is None:
            return _format_1(0, seq, ())
        if not row["new_format"]:
            return _format_1(int(row["transcript_id"]), seq, row["rows"] or ())
        return transcripts.from_rows(
            int(row["transcript_id"]), int(row["seq"]), ((slot, body, _size(body)) for slot, body in row["rows"] or ())
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
        """``record_step`` of a whole checkpoint: a step that does not say what it added.

        Raises:
            InputTooLargeError: the serialized checkpoint is over the size limit.
        """
        return self.record_step(
            records.StepWrite(
                checkpoint=checkpoint,
                drained_inbox=drained_inbox,
                approvals=tuple(approvals),
                events=tuple(drafts),
                settles_abort=settles_abort,
                paused_before=paused_before,
            )
        )

    def refuse(
        self,
        session_id: str,
        fence: int,
        error: records.LastError,
        approval_ids: Sequence[str],
        drafts: Sequence[records.EventDraft] = (),
    ) -> bool:
        """Park the run with a non-retryable ``error``, leaving its checkpoint as it was.

        Decisions of ``approval_ids`` that the run was about to act on go back to pending and
        the run back to awaiting approval, so a fixed agent can resolve them again.
        """
        body = payloads.dumps(error.model_copy(update={"retryable": False}).model_dump())
        with self._begin() as conn:
            parked = conn.execute(
                _FAIL, {"sid": session_id, "fence": fence, "error": body, **self._event_params(drafts)}
            ).first()
            if parked is None:
                return False
            if approval_ids:
                approval_rows.put_back(conn, session_id, approval_ids)
        return True

    def decisions(self, approval_ids: Sequence[str]) -> dict[str, records.Approval]:
        """The approvals of a pause, by id (for the step that continues the run)."""
        return approval_rows.PostgresApprovalStore(self.engine).by_ids(approval_ids)

    def note_usage(self, session_id: str, fence: int, usage: records.Usage) -> bool:
        """Keep a model call's usage before its turn is saved, so a crash in between still counts it."""
        with self._direct.connection() as conn:
            row = conn.execute(
                _DIRECT[_NOTE_USAGE], {"sid": session_id, "fence": fence, "usage": payloads.dumps(usage.model_dump())}
            ).fetchone()
        return row is not None

    def note_wait(self, session_id: str, fence: int) -> bool:
        """Take back the attempt this step's claim counted: it waits on a model limit; False when fenced out."""
        with self._direct.connection() as conn:
            row = conn.execute(_DIRECT[_NOTE_WAIT], {"sid": session_id, "fence": fence}).fetchone()
        return row is not None

    def start_children(
        self, lead: str, lead_agent: str, children: Sequence[tuple[str, str, str]], *, fence: int
    ) -> builtins.list[str]:
        """Create the child runs ``(child_id, agent, prompt)`` of ``lead`` that do not exist yet, with their input.

        A step write like any other: one transaction that holds the lead's row and checks its fence first, so a
        step that lost its lease, or whose lead was deleted meanwhile, creates nothing (and a ``delete`` waiting
        for the lead's row sees the children once it has it). A child that exists as the lead's (its step ran
        before and crashed) is left as it is; an id taken by a run that is not the lead's child is never adopted.

        Returns:
            The ids refused because another run holds them (nothing is written for those).

        Raises:
            FencedOutError: the lead is gone or its fence moved past ``fence`` (nothing is written).
        """
        ids = [child_id for child_id, _, _ in children]
        with self._begin() as conn:
            stored = conn.execute(_HOLD_LEAD, {"lead": lead}).scalar()
            if stored is None or int(stored) != fence:
                raise errors.FencedOutError(lead, fence)
            taken = set(conn.execute(_NOT_ITS_OWN, {"ids": ids, "lead": lead}).scalars())
            created = [
                child_id
                for child_id, agent, prompt in children
                if child_id not in taken
                and runs.create_run(conn, child_id, agent, [records.Message(role="user", content=prompt)])
            ]
            if created:
                conn.execute(_SET_PARENT, {"lead": lead, "lead_agent": lead_agent, "ids": created})
        return [child_id for child_id in ids if child_id in taken]

    def waiting_leads(self, stale_after_s: float, limit: int = 500) -> builtins.list[records.DueRun]:
        """Leads waiting on children none of which can still move (a lost wake-up, or none left), oldest first.

        Reads only the leads a child changed for since their last step began (``lead_news``), and drops the news
        of leads that stopped without waiting or are gone.
        """
        with self._single() as conn:
            conn.execute(_NEWS_DROPPED)
            rows = conn.execute(_WAITING_LEADS, {"stale": stale_after_s, "limit": limit}).all()
        return [
            records.DueRun(session_id=row.session_id, seq=int(row.seq), agent=row.agent, due=_EARLIEST) for row in rows
        ]

    def settle_end(self, session_id: str, fence: int, seq: int) -> bool:
        """Note that the ``on_run_end`` hooks owed since save ``seq`` have run (fenced); False when not owed."""
        with self._single() as conn:
            return conn.execute(_END_SETTLED, {"sid": session_id, "fence": fence, "seq": seq}).first() is not None

    def record_failure(
        self, session_id: str, fence: int, error: records.LastError, drafts: Sequence[records.EventDraft] = ()
    ) -> int | None:
        """Store why a step failed (fenced), with ``drafts`` as its events; the attempts count, None if fenced out."""
        with self._direct.connection() as conn:
            row = conn.execute(
                _DIRECT[_FAIL],
                {
                    "sid": session_id,
                    "fence": fence,
                    "error": payloads.dumps(error.model_dump()),
                    **self._event_params(drafts),
                },
            ).fetchone()
        return None if row is None else int(row["attempts"])

    def retry_later(
        self,
        session_id: str,
        fence: int,
        error: records.LastError,
        delay_s: float,
        drafts: Sequence[records.EventDraft] = (),
    ) -> int | None:
        """Record a transient failure (fenced), with ``drafts`` as its events, and when to try again.

        Returns the run's seq, None if fenced out.

        The crash-loop count restarts (the step did not crash), the failure streak grows and
        ``next_attempt_at`` is set ``delay_s`` from Postgres's now.
        """
        with self._direct.connection() as conn:
            row = conn.execute(
                _DIRECT[_RETRY_LATER],
                {
                    "sid": session_id,
                    "fence": fence,
                    "delay": max(delay_s, 0.0),
                    "error": payloads.dumps(error.model_dump()),
                    **self._event_params(drafts),
                },
            ).fetchone()
        return None if row is None else int(row["seq"])

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
        """Queue input for a run (creating the run) and return its inbox number.

        The run row is locked while the number is taken, so numbers follow commit order and
        sends from many processes are applied in the order they committed. A send with an
        ``idempotency_key`` already used on this run queues nothing and returns the first one's
        number (its metadata stays). New input clears a parked or waiting run's error: the run
        tries again with it. ``metadata`` is stored with the input (``InboxEntry.metadata``), and so is
        ``business_state`` (not None: it replaces the run's when the input is merged).

        Raises:
            SessionAwaitingApprovalError: the run waits on an approval.
            ConfigurationError: the session belongs to another agent, ``metadata`` is not a JSON object, or
                ``business_state`` is not JSON.
            InputTooLargeError: ``metadata`` is over 16 KiB as JSON, ``business_state`` over 64 KiB, or either too
                deep (nothing is written).
            CheckpointCorruptError: the stored run cannot be read.
        """
        metadata = runs.check_metadata(metadata)
        with self._begin() as conn:
            return runs.queue_input(
                conn, session_id, agent, messages, idempotency_key, metadata, business_state, fairness_key
            )

    def create_run(self, checkpoint: records.Checkpoint, queued: Sequence[records.Message] = ()) -> bool:
        """Store a new run as ``checkpoint`` (a fork), with ``queued`` input; False if the id is taken."""
        with self._begin() as conn:
            return runs.create_from(conn, checkpoint, queued)

    def reset_attempts(self, session_id: str, limits: dict[str, Any] | None = None) -> int | None:
        """Clear a parked or waiting run's error and retry time so it runs now (under ``limits``, when given).

        A run waiting on its children moves only when none of them can still move by itself (each settled,
        paused or gone): its step then records what they came to.

        Returns its seq, None when it has nothing to do (finished with no new input, paused, waiting on a child
        that still runs, unknown).
        """
        params = {"sid": session_id, "limits": None if limits is None else payloads.dumps(limits)}
        with self._begin() as conn:
            seq = conn.execute(_RESET_ATTEMPTS, params).scalar()
        return None if seq is None else int(seq)

    def request_abort(self, session_id: str) -> bool:
        """Ask for the run to stop: True when requested (or already), False when it is finished or aborted.

        Raises:
            CheckpointNotFoundError: no such run.
        """
        with self._begin() as conn:
            # The run's row before those under it, as ``delete`` takes them: the two never wait on each other.
            conn.execute(_HOLD_FOR_ABORT, {"sid": session_id})
            prefix = session_id + records.CHILD_MARK
            requested = {
                row.session_id
                for row in conn.execute(
                    _REQUEST_ABORT, {"sid": session_id, "prefix": prefix, "prefix_len": len(prefix)}
                )
            }
            if session_id in requested:
                return True
            if conn.execute(_EXISTS, {"sid": session_id}).first() is None:
                raise errors.CheckpointNotFoundError(f"run {session_id!r} is not stored")
        return False

    def abort_requested(self, session_id: str) -> bool:
        """Whether an abort of the run waits for a step to settle it (what a step checks when the doorbell rings)."""
        with self._direct.connection() as conn:
            row = conn.execute(_DIRECT[_ABORT_PENDING], {"sid": session_id}).fetchone()
        return bool(row and row["pending"])

    # -- readers ---------------------------------------------------------------------------

    def read_events(self, session_id: str, after: int, limit: int = 500) -> builtins.list[events.Event]:
        """Durable events of the run with a seq above ``after``, oldest first, at most ``limit``."""
        with self._single() as conn:
            rows = conn.execute(event_log.READ, {"sid": session_id, "after": after, "limit": limit}).all()
        return events.from_rows(session_id, rows)

    def input_start(self, session_id: str, number: int) -> int | None:
        """The seq of the ``run.start`` that merged input ``number`` (None while it is not merged)."""
        with self._single() as conn:
            found = conn.execute(event_log.INPUT_START, {"sid": session_id, "n": number}).scalar()
        return None if found is None else int(found)

    def latest_start(self, session_id: str) -> int | None:
        """The seq of the run's latest ``run.start`` event (None when it has none)."""
        with self._single() as conn:
            found = conn.execute(event_log.LATEST_START, {"sid": session_id}).scalar()
        return None if found is None else int(found)

    def load(self, session_id: str) -> records.Checkpoint | None:
        """The latest checkpoint of a run, or None.

        Raises:
            CheckpointCorruptError: the stored document does not parse as a checkpoint.
        """
        with self._single() as conn:
            row = conn.execute(_LOAD, {"sid": session_id}).first()
        return None if row is None else runs.row_checkpoint(row, session_id)

    def progress(self, session_id: str) -> records.Progress | None:
        """A run's status, inbox cursor and last error, without reading its transcript; None if unknown."""
        with self._single() as conn:
            row = conn.execute(_PROGRESS, {"sid": session_id}).first()
        if row is None:
            return None
        return records.Progress(
            status=row.status,
            inbox_cursor=row.inbox_cursor,
            inbox_head=row.inbox_head,
            last_error=row.last_error,
            aborted=row.aborted,
            events_next=row.events_next,
            finish_reason=row.finish_reason,
            agent=row.agent,
        )

    def list(
        self,
        *,
        statuses: Iterable[str] | None = None,
        agent: str | None = None,
        limit: int = 1000,
        newest: bool = False,
    ) -> builtins.list[records.Checkpoint | records.PendingRun]:
        """Latest checkpoints, optionally filtered; an unreadable one comes as a corrupt PendingRun."""
        clauses, params = [], {"limit": limit}
        if statuses is not None:
            clauses.append("status = ANY(:statuses)")
            params["statuses"] = list(statuses)  # type: ignore[assignment]  # bound as a text array
        if agent is not None:
            clauses.append("agent = :agent")
            params["agent"] = agent  # type: ignore[assignment]
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        order = "created_at DESC, session_id DESC" if newest else "created_at, session_id"
        query = text(f"SELECT {_COLUMNS}, {runs.MESSAGES} FROM runs {where} ORDER BY {order} LIMIT :limit")
        with self._begin() as conn:
            rows = conn.execute(query, params).all()
        found: builtins.list[records.Checkpoint | records.PendingRun] = []
        for row in rows:
            try:
                found.append(runs.row_checkpoint(row, row.session_id))
            except (errors.CheckpointCorruptError, errors.CheckpointFormatError) as exc:
                found.append(
                    records.unreadable_run(row.session_id, row.agent, row.status, row.attempts, exc, listed=True)
                )
        return found

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
        """A page of runs, newest first by creation, filtered and paged in one statement, without transcripts.

        Args:
            agents: only runs of these agents (None: any agent).
            states: only runs standing in these ``records.ListedState`` (None: any).
            id_contains: only runs whose id contains this text, whatever the case.
            since: only runs created at or after this time.
            limit: most runs on the page (1 to ``listing.MAX_LIMIT``).
            cursor: a ``next_cursor`` or ``prev_cursor`` of an earlier page (None: the newest runs).
            details: also read each listed run's finish reason, step and usage (from the page's documents only).

        Raises:
            ConfigurationError: a cursor no page gave, a limit out of range, an unknown state or a naive ``since``.
        """
        wanted = listing.RunFilter.of(agents, states, id_contains, since)
        position = None if cursor is None else listing.parse_cursor(cursor)
        with self._single() as conn:
            return listing.read(conn, wanted, listing.check_limit(limit), position, details)

    def count_runs(
        self, *, agents: Iterable[str] | None = None, since: datetime | None = None
    ) -> dict[records.ListedState, int]:
        """How many runs (of ``agents``, created at or after ``since``) stand in each state; states with none left out.

        Raises:
            ConfigurationError: a naive ``since``.
        """
        with self._single() as conn:
            return listing.count(conn, listing.RunFilter.of(agents, None, None, since))

    def history(self, session_id: str, limit: int | None = None) -> builtins.list[records.HistoryEntry]:
        """Saved states of a run, newest first; ``[]`` for an unknown run.

        At most ``history_limit`` entries (the ring may hold a few more, back to a keyframe).
        """
        wanted = None if self.history_limit <= 0 else self.history_limit
        if limit is not None:
            wanted = limit if wanted is None else min(wanted, limit)
        with self._single() as conn:
            return history.read(conn, session_id, wanted)

    def stale_runs(self, stale_after_s: float, limit: int = 500) -> builtins.list[tuple[str, int]]:
        """Runs that should be moving and did not save for ``stale_after_s``: (session_id, seq)."""
        return [(run.session_id, run.seq) for run in self.due_runs(stale_after_s, limit)]

    def due_runs(
        self, stale_after_s: float, limit: int = 500, after: records.DueRun | None = None
    ) -> builtins.list[records.DueRun]:
        """Runs a step can move now, most overdue first: silent for ``stale_after_s`` or due for a retry.

        Never paused or parked runs, nor runs waiting for a retry time still ahead, nor runs the sweep
        sent less than ``stale_after_s`` ago. ``after`` (the last run of the previous page) continues
        the listing.
        """
        params = {
            "stale": stale_after_s,
            "limit": limit,
            "after_due": after.due if after else _EARLIEST,
            "after_sid": after.session_id if after else "",
        }
        with self._single() as conn:
            rows = conn.execute(_DUE, params).all()
        return [
            records.DueRun(
                session_id=row.session_id, seq=int(row.seq), agent=row.agent, retrying=bool(row.retrying), due=row.due
            )
            for row in rows
        ]

    def expire_approvals(self, limit: int = 500) -> int:
        """Reject pending approvals past their ``expires_at``; runs left with none pending continue."""
        with self._single() as conn:
            return approval_rows.expire_due(conn, limit)

    def mark_swept(self, session_ids: Sequence[str]) -> None:
        """Note that the sweep just sent a step for these runs: ``due_runs`` leaves them out for a while.

        Each is marked recovering too (unless it is already), with where it stood: ``settle_recoveries`` reports
        how it came out.
        """
        if session_ids:
            with self._single() as conn:
                conn.execute(_MARK_SWEPT, {"ids": list(session_ids)})

    def settle_recoveries(self, agents: Sequence[str], limit: int = 500) -> builtins.list[records.SweptRun]:
        """The runs of ``agents`` the sweep sent on that came out since (``runs.RECOVERY_SETTLED``), each once.

        Their marks are cleared in the same statement, so no other sweep reports them again.
        """
        if not agents:
            return []
        with self._single() as conn:
            rows = conn.execute(_SETTLE_RECOVERIES, {"agents": list(agents), "limit": limit}).all()
        return [_swept(row) for row in rows]

    def pending(self, agent: str | None = None, limit: int = 1000) -> builtins.list[records.PendingRun]:
        """Runs that are not finished (every state but ``finished``), oldest first.

        A finished run with input it has not applied (queued, or whose step failed) is listed too.
        """
        query = _PENDING + (" AND agent = :agent" if agent is not None else "")
        query += " ORDER BY created_at, session_id LIMIT :limit"
        with self._single() as conn:
            rows = conn.execute(text(query), {"agent": agent, "limit": limit}).all()
        return [_pending(row) for row in rows]

    # -- maintenance -------------------------------------------------------------------------

    def delete(self, session_id: str, *, keep_history: bool = False) -> bool:
        """Drop a run's checkpoint and inbox (and its history unless ``keep_history``), its child runs with it.

        One transaction that holds the run's row before it lists the runs under it: a step starting children
        holds that row too (``start_children``), so children it commits while the delete waits are listed and go,
        and a step that comes after finds its lead gone and starts none. Rows are taken in one order (the run,
        then the runs under it by id, then approvals), the order ``approvals.resolve`` and ``request_abort`` use.
        """
        prefix = session_id + records.CHILD_MARK
        with self._begin() as conn:
            conn.execute(_HOLD_RUN, {"sid": session_id})
            under = conn.execute(_UNDER, {"n": len(prefix), "prefix": prefix}).scalars().all()
            for run_id in sorted(under, key=len, reverse=True):
                _delete_run(conn, run_id, keep_history)
            deleted = _delete_run(conn, session_id, keep_history)
        for run_id in (*under, session_id):
            self._transcripts.forget(run_id)
        return bool(deleted)

    def prune(self, older_than: datetime) -> int:
        """Drop finished runs last saved before ``older_than`` and history entries older than it."""
        if older_than.tzinfo is None:
            raise errors.ConfigurationError("prune needs a timezone-aware cutoff")
        with self._begin() as conn:
            runs = len(conn.execute(text(_PRUNE_RUNS), {"cutoff": older_than}).all())
            conn.execute(text("DELETE FROM checkpoint_history WHERE saved_at < :cutoff"), {"cutoff": older_than})
        return int(runs)

    def register_agents(self, fingerprints: dict[str, dict[str, Any]]) -> None:
        """Record the agents a worker serves, so producers can refuse unknown names."""
        if fingerprints:
            with self._begin() as conn:
                registry.register_names(conn, fingerprints)

    def known_agents(self) -> builtins.list[str]:
        """Names of agents some worker registered."""
        with self._begin() as conn:
            return registry.known_names(conn)

    def _event_params(self, drafts: Sequence[records.EventDraft]) -> dict[str, Any]:
        """Parameters of a failure statement's events (none when events are off)."""
        drafts = drafts if self.events else ()
        return {"n_events": len(drafts), "events": events.encode(drafts, lambda _: None) if drafts else "[]"}

    def _begin(self) -> Transaction:
        return Transaction(self.engine)

    def _single(self) -> Transaction:
        """For statements that are atomic on their own (no BEGIN/COMMIT round trips)."""
        return Transaction(self._autocommit)
