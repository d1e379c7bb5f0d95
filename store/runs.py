"""A run's row: creating runs, queueing input, reading the row back as a checkpoint, and the has-work rule.

Every statement that creates a run or queues input for one is here, in the caller's transaction, so sends,
forks, webhook deliveries and schedule ticks follow the same rules. Steps' own writes (claim, fenced save,
failures) stay in ``store.checkpoints``.

Stays whole: the run row's statements and the has-work rule they share (in SQL and in memory) change together.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy import Connection, text
from sqlalchemy.engine import Row, RowMapping

from store import errors, inputs, model_limit, payloads, records, transcripts

#: Columns of ``runs`` that make a checkpoint (with ``row_checkpoint``).
COLUMNS = (
    "session_id, agent, status, seq, fence, attempts, last_error, inbox_head, inbox_cursor, document,"
    " updated_at, uncounted_usage, next_attempt_at, retry_since, failures, transcript_id, aborted,"
    " end_due, waiting"
)
#: The whole transcript of the run of the row (format 2), as a JSON array in slot order, for readers.
MESSAGES = (
    "(SELECT COALESCE(jsonb_agg(m.message ORDER BY m.slot), '[]'::jsonb) FROM run_messages m"
    " WHERE m.session_id = runs.session_id) AS messages"
)
#: Adds ``:rows`` (``[[slot, message], ...]``) as messages of run ``:sid`` written by save ``:seq``.
ADD_MESSAGES = """
INSERT INTO run_messages (session_id, slot, seq, message)
SELECT :sid, CAST(e ->> 0 AS int), :seq, e -> 1 FROM jsonb_array_elements(CAST(:rows AS jsonb)) e
"""


def has_work_sql(table: str = "") -> str:
    """The one rule of which runs have work to do, as SQL on ``runs`` (aliased ``table``, if given).

    In progress (and not stopped by an abort or a budget, nor waiting on children), finished or stopped with
    input waiting, unfinished with an abort request no step has settled yet, or owing ``on_run_end`` hooks.
    Used by the claim, the sweep, ``resume``, ``pending`` and the
    schedule sweep's overlap check; ``has_work`` is the same rule for runs held in memory.
    """
    t = f"{table}." if table else ""
    return (
        f"(({t}status = 'in-progress' AND NOT {t}aborted AND NOT {t}waiting)"
        f" OR (({t}status = 'finished' OR {t}aborted) AND {t}inbox_head > {t}inbox_cursor)"
        f" OR ({t}abort_requested IS NOT NULL AND {t}status <> 'finished') OR {t}end_due)"
    )


def not_parked_sql(table: str = "") -> str:
    """SQL true for a run that is not parked: a run whose last error is not retryable waits for a person.

    ``is_parked`` is the same rule for runs held in memory.
    """
    t = f"{table}." if table else ""
    return f"({t}last_error IS NULL OR ({t}last_error ->> 'retryable')::boolean)"


def refused_sql(table: str = "") -> str:
    """SQL true for a run parked by a refusal to resume it (``records.is_refused`` in memory).

    Such a child is not settled: its lead keeps waiting on it until a person resumes it.
    """
    t = f"{table}." if table else ""
    codes = ", ".join(f"'{code}'" for code in records.REFUSAL_CODES)  # constants of ours, never input
    return f"(NOT {not_parked_sql(table)} AND {t}last_error ->> 'code' IN ({codes}))"


#: The columns of ``COLUMNS`` a checkpoint carries as fields (the rest are the document and bookkeeping).
_CHECKPOINT_COLUMNS = (
    "agent",
    "status",
    "seq",
    "fence",
    "attempts",
    "last_error",
    "inbox_cursor",
    "updated_at",
    "next_attempt_at",
    "retry_since",
    "failures",
    "aborted",
    "end_due",
    "waiting",
)
#: ``has_work_sql()`` and ``not_parked_sql()`` on the unaliased table.
HAS_WORK = has_work_sql()
NOT_PARKED = not_parked_sql()
#: What the recovery sweep notes when it sends a run on (``recovery``): where the run stood then.
RECOVERY_MARK = "COALESCE(recovery, jsonb_build_object('seq', seq, 'failures', failures))"
#: The one rule of when a run the sweep sent on has come out of that recovery: it failed again (parked, or one more
#: transient failure than when it was sent), or it saved since and its input ended (finished, paused on a person,
#: stopped). ``recovery_settled`` is the same rule for runs held in memory.
RECOVERY_SETTLED = (
    f"((last_error IS NOT NULL AND (NOT {NOT_PARKED}"
    " OR failures > (recovery ->> 'failures')::int))"
    " OR (last_error IS NULL AND seq > (recovery ->> 'seq')::bigint"
    " AND (status <> 'in-progress' OR aborted)))"
)

# A run recreated under an id whose history was kept (delete(keep_history=True)) continues its seq
# after that history: restarting at 0 would collide with the kept rows on every save.
#: The document of a new run: format 2 from the start, with no messages yet.
EMPTY_DOCUMENT = '{"format": 2, "messages_count": 0}'
# A new run's id may have held a run that an earlier release deleted or pruned, leaving message rows (before
# format 2) or event rows (before events): they go with the insert that makes the new run.
_CLEAR_LEFTOVERS = """,
cleared AS (DELETE FROM run_messages WHERE session_id = :sid AND EXISTS (SELECT 1 FROM made)),
cleared_events AS (DELETE FROM run_events WHERE session_id = :sid AND EXISTS (SELECT 1 FROM made))"""
_ENSURE_RUN = text(f"""
WITH made AS (
  INSERT INTO runs (session_id, agent, seq, document)
  SELECT :sid, :agent, COALESCE(MAX(seq), 0), CAST('{EMPTY_DOCUMENT}' AS jsonb)
  FROM checkpoint_history WHERE session_id = :sid
  ON CONFLICT (session_id) DO NOTHING RETURNING seq
){_CLEAR_LEFTOVERS}
SELECT seq FROM made
""")
_NEW_RUN = text(f"""
WITH made AS (
  INSERT INTO runs (session_id, agent, status, seq, inbox_head, document)
  SELECT :sid, :agent, :status, COALESCE(MAX(seq), 0), :head, CAST(:doc AS jsonb)
  FROM checkpoint_history WHERE session_id = :sid
  ON CONFLICT (session_id) DO NOTHING RETURNING seq
){_CLEAR_LEFTOVERS}
SELECT seq FROM made
""")
_ADD_MESSAGES = text(ADD_MESSAGES)
#: Bytes the run holds as JSON text: its document, its transcript's rows (format 2) and its input not merged yet.
#: Postgres writes JSON with a space after each separator, so this counts a little more than the save does.
_HELD_BYTES = """(octet_length(runs.document::text)
  + COALESCE((SELECT sum(octet_length(m.message::text)) FROM run_messages m
              WHERE m.session_id = runs.session_id AND runs.document -> 'messages_count' IS NOT NULL), 0)
  + COALESCE((SELECT sum(octet_length(i.messages::text)) FROM inbox i
              WHERE i.session_id = runs.session_id AND i.n > runs.inbox_cursor), 0))::bigint AS held_bytes"""
_LOCK_RUN = text(
    f"SELECT {COLUMNS}, document -> 'approval_ids' AS approvals, {_HELD_BYTES} FROM runs"
    " WHERE session_id = :sid FOR UPDATE"
)
# New input is a person acting on the run: a parked or waiting run tries again with it.
_BUMP_INBOX = text("""
UPDATE runs SET inbox_head = inbox_head + 1, last_error = NULL, attempts = 0, failures = 0, retry_since = NULL,
  next_attempt_at = NULL
WHERE session_id = :sid RETURNING inbox_head
""")
_SENT_BEFORE = text("SELECT n FROM sends WHERE session_id = :sid AND idempotency_key = :key")
_REMEMBER_SEND = text("INSERT INTO sends (session_id, idempotency_key, n) VALUES (:sid, :key, :n)")
_ADD_INBOX = text(
    "INSERT INTO inbox (session_id, n, messages, metadata)"
    " VALUES (:sid, :n, CAST(:messages AS jsonb), CAST(:metadata AS jsonb))"
)
#: Most bytes the metadata of one send may take as JSON.
MAX_METADATA_BYTES = 16 * 1024
#: Most bytes a run's business state may take as JSON (it is saved with every step of the run).
MAX_BUSINESS_STATE_BYTES = 64 * 1024


class InboxPosition(Protocol):
    """What ``has_work`` reads of a run (a record in memory)."""

    @property
    def status(self) -> str:
        """The run's ``status`` column."""
        ...

    @property
    def inbox_head(self) -> int:
        """The run's ``inbox_head`` column."""
        ...

    @property
    def inbox_cursor(self) -> int:
        """The run's ``inbox_cursor`` column."""
        ...

    @property
    def aborted(self) -> bool:
        """The run's ``aborted`` column."""
        ...

    @property
    def abort_requested(self) -> bool:
        """Whether the run's ``abort_requested`` column is set."""
        ...

    @property
    def end_due(self) -> bool:
        """The run's ``end_due`` column."""
        ...

    @property
    def waiting(self) -> bool:
        """The run's ``waiting`` column."""
        ...


def has_work(run: InboxPosition) -> bool:
    """True when a step has something to do: ``HAS_WORK`` for a run held in memory."""
    return (
        (run.status == "in-progress" and not run.aborted and not run.waiting)
        or ((run.status == "finished" or run.aborted) and run.inbox_head > run.inbox_cursor)
        or (run.abort_requested and run.status != "finished")
        or run.end_due
    )


class _Recovering(Protocol):
    status: records.Status
    seq: int
    failures: int
    aborted: bool
    last_error: dict[str, Any] | None
    recovery: dict[str, int] | None


def recovery_settled(run: _Recovering) -> bool:
    """True when a run the sweep sent on has come out of that recovery: ``RECOVERY_SETTLED`` in memory."""
    mark = run.recovery
    if mark is None:
        return False
    if run.last_error is not None:
        return is_parked(run.last_error) or run.failures > mark["failures"]
    return run.seq > mark["seq"] and (run.status != "in-progress" or run.aborted)


def is_parked(last_error: dict[str, Any] | records.LastError | None) -> bool:
    """True when the run stopped on an error that is not retryable: ``NOT NOT_PARKED`` in memory."""
    if last_error is None:
        return False
    retryable = last_error.retryable if isinstance(last_error, records.LastError) else last_error.get("retryable")
    return retryable is not True


def row_checkpoint(
    row: Row[Any] | RowMapping | Mapping[str, Any], session_id: str, messages: list[records.Message] | None = None
) -> records.Checkpoint:
    """The run's row (``COLUMNS``) as a checkpoint.

    The transcript of a format-2 run is ``messages`` when given, else the row's ``messages`` column
    (``MESSAGES``) when it has one, else left empty (for callers that do not read it).

    Raises:
        CheckpointFormatError: the checkpoint was written in a newer format than this code reads.
        CheckpointCorruptError: the stored document cannot be read.
    """
    mapping = row._mapping if isinstance(row, Row) else row
    # Only a format-2 document's transcript is its rows (rows under a format-1 run are a deleted run's leftovers).
    if messages is None and "messages" in mapping and "messages_count" in (mapping["document"] or {}):
        try:
            messages = [transcripts.message_from_row(body) for body in mapping["messages"] or ()]
        except (KeyError, TypeError, AttributeError) as exc:
            raise errors.CheckpointCorruptError(f"messages of run {session_id!r} cannot be read") from exc
    return records.stored_checkpoint(
        session_id,
        {name: mapping[name] for name in _CHECKPOINT_COLUMNS},
        mapping["document"] or {},
        mapping["uncounted_usage"],
        messages,
    )


def check_business_state(value: object) -> Any:
    """``value`` as a run's business state is stored: JSON of at most ``MAX_BUSINESS_STATE_BYTES``, text cleaned.

    The one rule for what ``send(..., business_state=...)``, a tool and a hook may write, checked before anything
    is written (a value that could not be saved would fail every later save of the run).

    Raises:
        ConfigurationError: holding a value JSON has no form for (or a key that is not a string).
        InputTooLargeError: nested deeper than input may be, or over ``MAX_BUSINESS_STATE_BYTES`` as JSON.
    """
    payloads.check_depth(value)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        raise errors.ConfigurationError(
            "business_state must be JSON: strings, finite numbers, booleans, None, lists and objects with string keys"
        ) from None
    clean = payloads.sanitize(value)
    if len(payloads.dumps(clean).encode("utf-8")) > MAX_BUSINESS_STATE_BYTES:
        raise errors.InputTooLargeError(f"business_state is at most {MAX_BUSINESS_STATE_BYTES} bytes as JSON")
    return clean


def stored_metadata(
    metadata: dict[str, Any] | None, business_state: Any = None, fairness_key: str | None = None
) -> dict[str, Any] | None:
    """What the inbox row keeps in its ``metadata`` column: the sender's metadata, the business state and fairness key.

    The state rides under ``records.BUSINESS_STATE_KEY`` (the fairness key under ``records.FAIRNESS_KEY``) so the
    input and what it comes with are one row (``records.InboxEntry.from_stored`` splits them again). All are
    checked already.
    """
    if business_state is None and fairness_key is None:
        return metadata
    stored = dict(metadata or {})
    if business_state is not None:
        stored[records.BUSINESS_STATE_KEY] = business_state
    if fairness_key is not None:
        stored[records.FAIRNESS_KEY] = fairness_key
    return stored


def check_metadata(metadata: object) -> dict[str, Any] | None:
    """``metadata`` as it is stored with its input: a JSON object of at most ``MAX_METADATA_BYTES``, text cleaned.

    The one rule for what a send may attach (``send(..., metadata=...)``), checked before anything is written.

    Raises:
        ConfigurationError: not a dict with string keys, or holding a value JSON has no form for.
        InputTooLargeError: nested deeper than input may be, or over ``MAX_METADATA_BYTES`` as JSON.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(key, str) for key in metadata):
        raise errors.ConfigurationError("metadata must be a JSON object (a dict with string keys)")
    if records.BUSINESS_STATE_KEY in metadata:
        raise errors.ConfigurationError(
            f"metadata key {records.BUSINESS_STATE_KEY!r} is reserved; send the business state as business_state="
        )
    if records.FAIRNESS_KEY in metadata:
        raise errors.ConfigurationError(f"metadata key {records.FAIRNESS_KEY!r} is reserved; send it as fairness_key=")
    payloads.check_depth(metadata)
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError):
        raise errors.ConfigurationError(
            "metadata values must be JSON: strings, finite numbers, booleans, None, lists and objects"
        ) from None
    clean: dict[str, Any] = payloads.sanitize(metadata)
    if len(payloads.dumps(clean).encode("utf-8")) > MAX_METADATA_BYTES:
        raise errors.InputTooLargeError(f"metadata is at most {MAX_METADATA_BYTES} bytes as JSON")
    return clean


def queue_input(
    conn: Connection,
    session_id: str,
    agent: str,
    messages: Sequence[records.Message],
    idempotency_key: str | None = None,
    metadata: dict[str, Any] | None = None,
    business_state: Any = None,
    fairness_key: str | None = None,
) -> int:
    """Queue ``messages`` for the run (creating it when absent), in the caller's transaction; its inbox number.

    The run row is locked while the number is taken, so numbers follow commit order. A key already
    used on this run queues nothing and returns the first send's number (the first send's ``metadata``
    stays). ``business_state`` (not None) replaces the run's when the step that merges this input saves it, and so
    does ``fairness_key`` (not None): the run's waits for a model slot go round-robin by it.
    New input clears a parked or waiting run's error: the run tries again with it. Input that
    would leave the run less than a reply's room under the checkpoint limit, with its transcript and the
    input queued before, is refused: a step could never save it (``inputs.leaves_room``).

    Raises:
        SessionAwaitingApprovalError: the run waits on an approval.
        ConfigurationError: the run belongs to another agent, ``metadata`` is not a JSON object, or the fairness key
            is not valid.
        InputTooLargeError: ``metadata`` or ``business_state`` is too large or too deep, or the run has no room for
            the input (nothing is written).
        CheckpointCorruptError: the stored run cannot be read (an unreadable run takes no input).
        CheckpointFormatError: the stored run is in a newer checkpoint format than this code reads.
    """
    metadata = stored_metadata(
        check_metadata(metadata),
        None if business_state is None else check_business_state(business_state),
        None if fairness_key is None else model_limit.validate_fairness_key(fairness_key),
    )
    conn.execute(_ENSURE_RUN, {"sid": session_id, "agent": agent})
    row = conn.execute(_LOCK_RUN, {"sid": session_id}).one()
    if row.document:
        row_checkpoint(row, session_id)
    if row.agent != agent:
        raise errors.ConfigurationError(f"session {session_id!r} belongs to agent {row.agent!r}, not {agent!r}")
    if idempotency_key is not None:
        earlier = conn.execute(_SENT_BEFORE, {"sid": session_id, "key": idempotency_key}).scalar()
        if earlier is not None:
            return int(earlier)
    if row.status == "awaiting-approval":
        waiting = row.approvals or []
        raise errors.SessionAwaitingApprovalError(session_id, waiting[0] if waiting else None)
    body = _dump(messages)
    held = int(row.held_bytes) + len(body.encode("utf-8"))
    if not inputs.leaves_room(held):
        raise inputs.no_room(session_id, held, queued=False)
    number = int(conn.execute(_BUMP_INBOX, {"sid": session_id}).scalar_one())
    conn.execute(_ADD_INBOX, {"sid": session_id, "n": number, "messages": body, "metadata": _dump_metadata(metadata)})
    if idempotency_key is not None:
        conn.execute(_REMEMBER_SEND, {"sid": session_id, "key": idempotency_key, "n": number})
    return number


def create_run(
    conn: Connection,
    session_id: str,
    agent: str,
    messages: Sequence[records.Message],
    metadata: dict[str, Any] | None = None,
    fairness_key: str | None = None,
) -> bool:
    """Create the run ``session_id`` with ``messages`` (and ``metadata``) as its first input, in ``conn``'s transaction.

    ``fairness_key`` (checked already) rides with the input and becomes the run's when it is merged.

    Returns False, writing nothing, when a run with that id exists.

    Raises:
        ConfigurationError: ``metadata`` is not a JSON object.
        InputTooLargeError: ``metadata`` is too large or too deep (nothing is written).
    """
    return _insert(
        conn,
        session_id,
        agent,
        "in-progress",
        EMPTY_DOCUMENT,
        messages,
        metadata=stored_metadata(check_metadata(metadata), fairness_key=fairness_key),
    )


def create_from(conn: Connection, checkpoint: records.Checkpoint, queued: Sequence[records.Message] = ()) -> bool:
    """Create a run whose state is ``checkpoint`` (a fork), with ``queued`` input; False if the id is taken.

    Stored in format 2: its messages are rows written with the run.
    """
    messages = checkpoint.messages
    document = format_document(checkpoint.model_copy(update={"history_seq": None}), len(messages))
    rows = (
        "["
        + ",".join(
            f"[{slot},{payloads.dumps(m.dump())}]"
            for slot, m in zip(transcripts.slots_of(messages), messages, strict=True)
        )
        + "]"
    )
    return _insert(conn, checkpoint.session_id, checkpoint.agent, checkpoint.status, document, queued, rows)


def format_document(checkpoint: records.Checkpoint, messages_count: int) -> str:
    """The run document of ``checkpoint`` in format 2: no transcript, the format and the message count."""
    document = checkpoint.control_document()
    document["format"] = 3 if any(key in document for key in records.FORMAT_3_FIELDS) else records.CHECKPOINT_FORMAT
    document["messages_count"] = messages_count
    return payloads.dumps(document)


def _insert(
    conn: Connection,
    session_id: str,
    agent: str,
    status: str,
    document: str,
    queued: Sequence[records.Message],
    rows: str = "[]",
    metadata: dict[str, Any] | None = None,
) -> bool:
    created = conn.execute(
        _NEW_RUN, {"sid": session_id, "agent": agent, "status": status, "doc": document, "head": 1 if queued else 0}
    ).first()
    if created is None:
        return False
    if rows != "[]":
        conn.execute(_ADD_MESSAGES, {"sid": session_id, "seq": int(created.seq), "rows": rows})
    if queued:
        conn.execute(
            _ADD_INBOX, {"sid": session_id, "n": 1, "messages": _dump(queued), "metadata": _dump_metadata(metadata)}
        )
    return True


def _dump(messages: Sequence[records.Message]) -> str:
    return payloads.dumps([m.dump() for m in messages])


def _dump_metadata(metadata: dict[str, Any] | None) -> str | None:
    return None if metadata is None else payloads.dumps(metadata)
