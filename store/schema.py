"""SQLAlchemy table definitions: the one description of every table, used by Alembic and tests.

Queries live in the store modules; this file only declares shapes and indexes.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    Table,
    Text,
    false,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData()

#: Numbers of run transcripts: a run gets a new one when it is created and when its stored messages are
#: rewritten, so a process that remembers the messages of a run knows when that memory is void.
transcript_ids = Sequence("run_transcript_ids", metadata=metadata)

#: Runs with work to do (``store.runs.has_work_sql``, spelled out: this module imports no other), the
#: predicate of the sweep's indexes.
MOVABLE = (
    "((status = 'in-progress' AND NOT aborted AND NOT waiting)"
    " OR ((status = 'finished' OR aborted) AND inbox_head > inbox_cursor)"
    " OR (abort_requested IS NOT NULL AND status <> 'finished')"
    " OR end_due)"
)

#: Runs not parked (``store.runs.not_parked_sql``, spelled out): a parked run waits for a person, not for the sweep.
NOT_PARKED = "(last_error IS NULL OR (last_error ->> 'retryable')::boolean)"

#: The latest checkpoint of each run: control fields as columns, the rest in ``document``.
runs = Table(
    "runs",
    metadata,
    Column("session_id", Text, primary_key=True),
    Column("agent", Text, nullable=False),
    Column("status", Text, nullable=False, server_default="in-progress"),
    Column("seq", BigInteger, nullable=False, server_default="0"),
    Column("fence", BigInteger, nullable=False, server_default="0"),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("last_error", JSONB, nullable=True),
    Column("inbox_head", BigInteger, nullable=False, server_default="0"),
    Column("inbox_cursor", BigInteger, nullable=False, server_default="0"),
    Column("document", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    #: Usage of a model call whose turn was not saved (its worker died); folded in at the next save.
    Column("uncounted_usage", JSONB, nullable=True),
    #: When a run that failed transiently may be tried again (the sweep leaves it alone until then).
    Column("next_attempt_at", DateTime(timezone=True), nullable=True),
    #: Start of the current streak of transient failures; the retry budget counts from here.
    Column("retry_since", DateTime(timezone=True), nullable=True),
    #: Transient failures in a row since the last save (the backoff exponent).
    Column("failures", Integer, nullable=False, server_default="0"),
    #: When the recovery sweep last sent a step for the run; it sends again only a lease TTL later, so a
    #: backlog in the queue does not turn into a pile of duplicates.
    Column("swept_at", DateTime(timezone=True), nullable=True),
    #: Which transcript the run's ``run_messages`` rows are (see ``transcript_ids``).
    Column("transcript_id", BigInteger, nullable=False, server_default=transcript_ids.next_value()),
    #: The seq the run's next durable event gets (``run_events``).
    Column("events_next", BigInteger, nullable=False, server_default="0"),
    #: When an abort was requested that no step has settled yet.
    Column("abort_requested", DateTime(timezone=True), nullable=True),
    #: The run stopped on an abort; it has no work until a send or a resume.
    Column("aborted", Boolean, nullable=False, server_default=false()),
    #: The run's input ended and its ``on_run_end`` hooks have not all run yet (the sweep moves it until they have).
    Column("end_due", Boolean, nullable=False, server_default=false()),
    #: The lead of a child run (``<lead>.task-<16 hex>``); None for a run of its own.
    Column("parent_id", Text, nullable=True),
    #: The run delegated calls to children that have not all settled: no step is due until one settles.
    Column("waiting", Boolean, nullable=False, server_default=false()),
    #: The recovery sweep sent the run on and has not yet told its agent how it came out: ``{"seq", "failures"}``
    #: as they were when it was sent (``on_recovered``/``on_error``).
    Column("recovery", JSONB, nullable=True),
    #: The ``lead_news`` number the run's last claim found: its save marks it seen (``lead_news``).
    Column("news_claimed", BigInteger, nullable=False, server_default="0"),
    Index("runs_status_updated_idx", "status", "updated_at"),
    Index("runs_parent_idx", "parent_id", postgresql_where=text("parent_id IS NOT NULL")),
    Index("runs_waiting_idx", "updated_at", postgresql_where=text("waiting")),
    #: Finished runs of their own by last save: what the retention sweep reads (``store.retention``).
    Index("runs_retention_idx", "updated_at", postgresql_where=text("status = 'finished' AND parent_id IS NULL")),
    #: Runs by creation: the keyset a page of the runs listing is read by (``store.listing``).
    Index("runs_created_idx", "created_at", "session_id"),
    #: Runs whose recovery the sweep has yet to report.
    Index("runs_recovery_idx", "session_id", postgresql_where=text("recovery IS NOT NULL")),
    #: Runs a step can move, not parked, by last save (no retry time) or by retry time: the two ranges the
    #: recovery sweep reads (``store.checkpoints``, migration 0021).
    Index(
        "runs_stale_idx",
        "updated_at",
        "session_id",
        postgresql_where=text(f"{MOVABLE} AND {NOT_PARKED} AND next_attempt_at IS NULL"),
    ),
    Index(
        "runs_retry_idx",
        "next_attempt_at",
        "session_id",
        postgresql_where=text(f"{MOVABLE} AND {NOT_PARKED} AND next_attempt_at IS NOT NULL"),
    ),
    #: Sub-agent runs by last save: where retention looks for those whose lead is gone (``store.retention``).
    Index("runs_child_age_idx", "updated_at", postgresql_where=text("parent_id IS NOT NULL")),
)

#: Numbers of children's news for their leads, one sequence: a lead's row dropped and written again is never behind
#: a number a claim copied before.
lead_news_ids = Sequence("lead_news_ids", metadata=metadata)

#: News of a lead's children: ``n`` the number of a child's last change that can matter to the lead (it stopped
#: moving, changed while stopped, or was deleted), ``seen`` the number the lead's last waiting save had claimed.
#: Written by the triggers ``runs_child_news`` and ``runs_gone`` on ``runs`` (function ``lousho_child_news``,
#: migration 0022, which SQLAlchemy does not declare); the sweep of waiting leads reads the rows with unseen news.
lead_news = Table(
    "lead_news",
    metadata,
    Column("lead_id", Text, primary_key=True),
    Column("n", BigInteger, nullable=False),
    Column("seen", BigInteger, nullable=False, server_default="0"),
    Index("lead_news_unseen_idx", "lead_id", postgresql_where=text("n > seen")),
)

#: A ring of the newest saves of each run, written in the same statement as each save.
checkpoint_history = Table(
    "checkpoint_history",
    metadata,
    Column("session_id", Text, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("step", Integer, nullable=False),
    Column("status", Text, nullable=False),
    Column("saved_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("document", JSONB, nullable=False),
    PrimaryKeyConstraint("session_id", "seq"),
    Index("checkpoint_history_saved_idx", "saved_at"),
)

#: The messages of runs stored in checkpoint format 2, one row each, never rewritten by a step: ``slot`` is the
#: message's place in the transcript, ``seq`` the save that wrote it (a history entry at seq S is the rows with
#: seq <= S). Events of a run can point at a row by ``(session_id, slot)``.
run_messages = Table(
    "run_messages",
    metadata,
    Column("session_id", Text, nullable=False),
    Column("slot", Integer, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("message", JSONB, nullable=False),
    PrimaryKeyConstraint("session_id", "slot"),
)

#: A run's durable events (``store.events``), numbered from 0 by ``runs.events_next``; ``slot`` points at the
#: ``run_messages`` row the event is about (a model turn, a tool result), if any.
run_events = Table(
    "run_events",
    metadata,
    Column("session_id", Text, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("type", Text, nullable=False),
    Column("slot", Integer, nullable=True),
    Column("data", JSONB, nullable=False),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("session_id", "seq"),
)

#: Input sent to a run, durable before it is enqueued; ``n`` is per run and follows commit order.
inbox = Table(
    "inbox",
    metadata,
    Column("session_id", Text, nullable=False),
    Column("n", BigInteger, nullable=False),
    Column("messages", JSONB, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    #: What the sender attached for the application's code (``send(..., metadata=...)``).
    Column("metadata", JSONB, nullable=True),
    PrimaryKeyConstraint("session_id", "n"),
)

#: Agents the workers know, registered at worker start so producers can refuse unknown names.
agents = Table(
    "agents",
    metadata,
    Column("name", Text, primary_key=True),
    Column("fingerprint", JSONB, nullable=True),
    Column("seen_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

#: Which live worker serves which agent, with the tools and stored formats it can run (rolling deploys).
agent_workers = Table(
    "agent_workers",
    metadata,
    Column("agent", Text, nullable=False),
    Column("worker_id", Text, nullable=False),
    Column("fingerprint", JSONB, nullable=True),
    Column("formats", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("seen_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # The model limit the worker holds the agent's calls to (key and numbers), None without one.
    Column("model_limit", JSONB, nullable=True),
    PrimaryKeyConstraint("agent", "worker_id"),
    Index("agent_workers_seen_idx", "seen_at"),
)

#: Idempotency keys of sends: a retried send with the same key is applied once (kept with the run).
sends = Table(
    "sends",
    metadata,
    Column("session_id", Text, nullable=False),
    Column("idempotency_key", Text, nullable=False),
    Column("n", BigInteger, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("session_id", "idempotency_key"),
)

#: One row per gated tool call of a paused run; decided once, or withdrawn when its run is gone.
approvals = Table(
    "approvals",
    metadata,
    Column("approval_id", Text, primary_key=True),
    Column("session_id", Text, nullable=False),
    Column("tool_call_id", Text, nullable=False),
    Column("tool_name", Text, nullable=False),
    Column("args", JSONB, nullable=False),
    Column("agent", Text, nullable=False),
    Column("status", Text, nullable=False, server_default="pending"),
    Column("note", Text, nullable=True),
    Column("fingerprint", JSONB, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("decided_at", DateTime(timezone=True), nullable=True),
    #: ``tool`` (a gated call) or ``question`` (``ask_question``: the person answers it).
    Column("kind", Text, nullable=False, server_default="tool"),
    Column("question", Text, nullable=True),
    Column("options", JSONB, nullable=True),
    Column("answer", Text, nullable=True),
    #: Past this time a pending approval counts as rejected (the recovery sweep decides it so).
    Column("expires_at", DateTime(timezone=True), nullable=True),
    Index("approvals_session_idx", "session_id"),
    Index("approvals_pending_idx", "created_at", postgresql_where=text("status = 'pending'")),
    Index("approvals_expiry_idx", "expires_at", postgresql_where=text("status = 'pending' AND expires_at IS NOT NULL")),
)

#: Webhook deliveries: one per (agent, delivery id), written with its run and first input in one transaction.
deliveries = Table(
    "deliveries",
    metadata,
    Column("agent", Text, nullable=False),
    Column("delivery_id", Text, nullable=False),
    Column("session_id", Text, nullable=False),
    Column("source", Text, nullable=False),
    Column("body_sha256", Text, nullable=False),
    Column("received_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("agent", "delivery_id"),
    Index("deliveries_session_idx", "session_id"),
    Index("deliveries_received_idx", "received_at"),
)

#: Bodies of accepted GitHub deliveries per agent: GitHub signs only the body, so a replay under a
#: new delivery id is recognised by the body's hash.
delivery_bodies = Table(
    "delivery_bodies",
    metadata,
    Column("agent", Text, nullable=False),
    Column("body_sha256", Text, nullable=False),
    Column("delivery_id", Text, nullable=False),
    Column("received_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("agent", "body_sha256"),
    Index("delivery_bodies_received_idx", "received_at"),
)

#: Schedules: cron (in ``timezone``) or every ``every_s`` seconds; ``next_fire_at`` is the next unhandled tick.
schedules = Table(
    "schedules",
    metadata,
    Column("schedule_id", BigInteger, Identity(always=True), primary_key=True),
    Column("name", Text, nullable=False, unique=True),
    Column("agent", Text, nullable=False),
    Column("input", JSONB, nullable=False),
    Column("cron", Text, nullable=True),
    Column("every_s", Integer, nullable=True),
    Column("timezone", Text, nullable=False, server_default="UTC"),
    Column("overlap", Text, nullable=False, server_default="skip"),
    Column("catch_up", Text, nullable=False, server_default="one"),
    Column("paused", Boolean, nullable=False, server_default=false()),
    Column("origin", Text, nullable=False, server_default="api"),
    Column("next_fire_at", DateTime(timezone=True), nullable=False),
    Column("last_fire_at", DateTime(timezone=True), nullable=True),
    Column("last_session_id", Text, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    #: Why the schedule cannot fire (set by the sweep, which then skips it); NULL when healthy.
    Column("broken_error", Text, nullable=True),
    Column("broken_at", DateTime(timezone=True), nullable=True),
    #: The fairness key of the runs it starts (their waits for a model slot go round-robin by it); NULL: none.
    Column("fairness_key", Text, nullable=True),
    CheckConstraint("(cron IS NULL) <> (every_s IS NULL)", name="schedules_one_timing"),
    Index("schedules_due_idx", "next_fire_at", postgresql_where=text("NOT paused AND broken_error IS NULL")),
)

#: Claimed ticks, unique per (schedule, fire time), written in the transaction that creates the tick's run.
schedule_fires = Table(
    "schedule_fires",
    metadata,
    Column("schedule_id", BigInteger, ForeignKey("schedules.schedule_id", ondelete="CASCADE"), nullable=False),
    Column("fire_at", DateTime(timezone=True), nullable=False),
    Column("session_id", Text, nullable=True),
    Column("outcome", Text, nullable=False),
    Column("claimed_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("schedule_id", "fire_at"),
    Index("schedule_fires_claimed_idx", "claimed_at"),
)

#: Runs the latest look of the I19 checker (``store.doctor``) found with nothing to explain them past the grace, and
#: when a look first saw each so: a run counts as unexplained once a later look still sees it so, unchanged.
doctor_runs = Table(
    "doctor_runs",
    metadata,
    Column("session_id", Text, primary_key=True),
    Column("first_seen", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("since", DateTime(timezone=True), nullable=False),
)

#: The latest look's figures, by checker (``lousho_runs_unexplained`` is read from here at each scrape).
doctor_looks = Table(
    "doctor_looks",
    metadata,
    Column("name", Text, primary_key=True),
    Column("looked_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("unexplained", Integer, nullable=False),
    Column("checked", Integer, nullable=False),
    Column("complete", Boolean, nullable=False),
)
