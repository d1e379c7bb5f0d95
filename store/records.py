"""Records that cross package boundaries: transcripts, checkpoints, runs, and what the stores exchange.

Messages, checkpoints, history and pending runs, and what the ports of ``store.interfaces`` exchange with their
callers (claims, step writes, decisions, leases, deliveries). Rows become these records inside ``store/`` only;
nothing here touches a database. It stays whole so that every record a run's callers hold has one address
(schedule records live in ``store.schedule_records``, next to their checks).

Stays whole: the records that cross package boundaries, in one module so every package imports one definition.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from store import errors

Role = Literal["system", "user", "assistant", "tool"]
Status = Literal["in-progress", "awaiting-approval", "finished"]
FinishReason = Literal[
    "stop", "length", "content-filter", "awaiting-approval", "max-steps", "aborted", "budget-exceeded"
]
#: Where an unfinished run stands, the one vocabulary of the API, the CLI, HTTP, the pages and metric labels
#: (see ``run_state`` and ``listed_state``):
#:
#: - ``running``: it has work (a worker holds it, or a step message is on its way);
#: - ``retrying``: a step failed transiently and the next attempt is due at ``next_attempt_at``;
#: - ``waiting``: on its sub-agents' runs (one of them may itself wait on a person);
#: - ``awaiting-approval``: on a decision of a person (tool approvals, questions, reconciliations);
#: - ``parked``: stopped by an error that will not heal by itself;
#: - ``aborted`` and ``budget-exceeded``: stopped by ``abort()`` or at a limit, until a send or a resume.
RunState = Literal["running", "retrying", "waiting", "awaiting-approval", "parked", "aborted", "budget-exceeded"]
#: Where a listed run stands: a ``RunState``, or ``finished`` (see ``listed_state``).
ListedState = Literal[
    "running", "retrying", "waiting", "awaiting-approval", "parked", "aborted", "budget-exceeded", "finished"
]
LISTED_STATES: tuple[ListedState, ...] = (
    "running",
    "retrying",
    "waiting",
    "awaiting-approval",
    "parked",
    "aborted",
    "budget-exceeded",
    "finished",
)
#: Words of an earlier release a state filter still takes, and the state each stands for (kept for one release).
STATE_ALIASES: dict[str, ListedState] = {"paused": "awaiting-approval"}

#: The stored checkpoint format this release writes: 2, the transcript as append-only rows (``store.transcripts``)
#: and the rest in the run's document; 1 held the whole transcript in the document. Formats change in two
#: steps: the schema first only adds, so the previous release keeps running beside this one, and a step
#: that meets a newer format than it reads hands the run back to a worker that can (a rolling deploy),
#: it never parks it; runs still in the old format are moved once no old worker is left.
CHECKPOINT_FORMAT = 2
#: The formats this release reads (workers register them, so handed-back steps find a reader). Format 3 is
#: format 2 with fields of dynamic agents and budgets (``FORMAT_3_FIELDS``), written only by runs that use them.
READ_FORMATS = (1, 2, 3)

#: Run ids: 1-200 of letters, digits, ``_ - .``; no leading or trailing dot.
_RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,200}")
#: Suffixes that other keys of a run use (session turns, paused sessions, schedule fire claims).
_RESERVED_SUFFIX = re.compile(r"(\.turn-\d+|\.paused|\.fire)$")
#: The suffix of a child run's id: ``<lead>.task-<16 hex digits>`` (made by the lead's step, never by a sender).
CHILD_MARK = ".task-"
_CHILD_SUFFIX = re.compile(r"\.task-[0-9a-f]{16}$")


def is_child_id(session_id: str) -> bool:
    """Whether ``session_id`` names a child run (a sub-agent's), which only its lead's step creates."""
    return _CHILD_SUFFIX.search(session_id) is not None


def lead_of(session_id: str) -> str | None:
    """The lead of a child run, or None for a run of its own."""
    return session_id[: session_id.rindex(CHILD_MARK)] if is_child_id(session_id) else None


def runs_to(session_id: str) -> list[str]:
    """``session_id``'s leads, outermost first, then ``session_id`` itself."""
    path = [session_id]
    while (lead := lead_of(path[0])) is not None:
        path.insert(0, lead)
    return path


def depth_of(session_id: str) -> int:
    """How many leads a run has above it (0 for a run of its own)."""
    depth = 0
    while (lead := lead_of(session_id)) is not None:
        session_id, depth = lead, depth + 1
    return depth


def validate_session_id(session_id: object) -> str:
    """Return ``session_id`` when it is a valid run id.

    Checked before the id reaches a Redis key or a row, so a bad id writes nothing.

    Raises:
        SessionIdInvalidError: the id breaks one of the rules.
    """
    if not isinstance(session_id, str):
        raise errors.SessionIdInvalidError(session_id, "must be a string")
    if not _RUN_ID.fullmatch(session_id):
        raise errors.SessionIdInvalidError(session_id, "use 1-200 letters, digits, '_', '-' or '.'")
    if session_id.startswith(".") or session_id.endswith("."):
        raise errors.SessionIdInvalidError(session_id, "must not start or end with '.'")
    if _RESERVED_SUFFIX.search(session_id):
        raise errors.SessionIdInvalidError(session_id, "ends with a reserved suffix (.turn-N, .paused, .fire)")
    return session_id


#: Agent names: they name the agent's step queue (``<queue>.<agent>``) and appear in run ids.
_AGENT_NAME = re.compile(r"[A-Za-z0-9_-]{1,100}")


def matching(value: object, pattern: re.Pattern[str], what: str, rule: str) -> str:
    """Return ``value`` when it is text that ``pattern`` matches whole (names that reach keys, queues and ids).

    Raises:
        ConfigurationError: it does not; the message names ``what`` and says the ``rule``.
    """
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise errors.ConfigurationError(f"invalid {what} {str(value)[:80]!r}: use {rule}")
    return value


def validate_agent_name(name: object) -> str:
    """Return ``name`` when it can name an agent: 1-100 letters, digits, ``_`` or ``-``.

    Raises:
        ConfigurationError: the name breaks the rule.
    """
    return matching(name, _AGENT_NAME, "agent name", "1-100 letters, digits, '_' or '-'")


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ToolCall(_Record):
    """One call an assistant turn asks for; ``id`` is stable across re-runs of the call.

    ``invalid_args`` holds the model's raw argument text when it was not a JSON object; the call
    then gets a validation error result the model can correct, instead of running.
    """

    id: str
    name: str
    args: dict[str, Any] = Field(default_factory=dict)
    invalid_args: str | None = None


class Message(_Record):
    """One transcript entry in the usual chat shape."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    role: Role
    content: Any = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    is_error: bool | None = None
    #: A tool result a hook chose instead of the call's own (``Result`` from ``pre_tool_call`` or ``post_tool_call``).
    replaced_by_hook: bool | None = None

    def dump(self) -> dict[str, Any]:
        """The message as a plain dict without unset fields."""
        return self.model_dump(mode="json", exclude_none=True)


class Usage(_Record):
    """Token totals; they add up across the steps and resumes of one run."""

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            total_tokens=self.total_tokens + other.total_tokens,
            cache_read_tokens=self.cache_read_tokens + other.cache_read_tokens,
            cache_write_tokens=self.cache_write_tokens + other.cache_write_tokens,
        )


class LastError(_Record):
    """Why the last attempt at a step failed; ``retryable=False`` parks the run."""

    code: str
    message: str = ""
    retryable: bool = False


#: Codes of a refusal to resume a run: its agent changed under it (``on_agent_drift="error"``) or lacks a tool its
#: pending calls name. The run is parked until a person puts the agent back and resumes it; a lead waiting on it
#: waits with it (the call it delegated gets no result meanwhile).
REFUSAL_CODES = (errors.AgentDriftError.code, errors.ResumeToolMissingError.code)


def is_refused(last_error: LastError | dict[str, Any] | None) -> bool:
    """Whether a run was parked by a refusal to resume it (``REFUSAL_CODES``); ``runs.refused_sql`` in SQL."""
    if last_error is None:
        return False
    if isinstance(last_error, LastError):
        return not last_error.retryable and last_error.code in REFUSAL_CODES
    return last_error.get("retryable") is not True and last_error.get("code") in REFUSAL_CODES


#: Checkpoint fields stored as columns of the run's row, never in its document.
_COLUMN_FIELDS: set[str] = {
    "session_id",
    "status",
    "last_error",
    "attempts",
    "seq",
    "fence",
    "updated_at",
    "inbox_cursor",
    "uncounted_usage",
    "next_attempt_at",
    "retry_since",
    "failures",
    "format",
    "aborted",
    "end_due",
    "waiting",
}
#: Document fields a format-2 reader does not know: a document with any of them is written as format 3, so a
#: worker of an earlier release hands the run back instead of failing to read it.
FORMAT_3_FIELDS = (
    "run_config",
    "limits",
    "clock_spent_s",
    "clock_since",
    "metadata",
    "active_agent",
    "delegated",
    "lead_agent",
    "background",
    "trace",
    "fairness_key",
)


class Checkpoint(_Record):
    """The whole state of one run: its transcript, counters and control fields.

    ``seq`` counts saves (each save writes ``seq + 1``); ``fence`` is the fencing token of the
    lease holder that may write next. ``run_start`` is the index in ``messages`` where the
    current run's input begins, ``inbox_cursor`` the last inbox entry merged into it.
    """

    session_id: str
    agent: str
    status: Status = "in-progress"
    messages: list[Message] = Field(default_factory=list)
    step: int = 0
    usage: Usage = Field(default_factory=Usage)
    business_state: Any = None
    approval_ids: list[str] = Field(default_factory=list)
    started_tool_call_ids: list[str] = Field(default_factory=list)
    last_error: LastError | None = None
    attempts: int = 0
    fingerprint: dict[str, Any] | None = None
    finish_reason: FinishReason | None = None
    run_start: int = 0
    inbox_cursor: int = 0
    seq: int = 0
    fence: int = 0
    updated_at: datetime | None = None
    #: The seq of the history entry this state was saved as (None when it was not saved with history).
    history_seq: int | None = None
    #: Usage reported for model calls whose turn is not saved yet (already included in ``usage``).
    uncounted_usage: Usage | None = None
    #: When a transiently failed step may be tried again; the recovery sweep leaves the run alone until then.
    next_attempt_at: datetime | None = None
    #: Start of the current streak of transient failures (the retry budget counts from here).
    retry_since: datetime | None = None
    #: Transient failures in a row since the last save.
    failures: int = 0
    #: The stored format the document was written in (only written once it differs from 1).
    format: int = CHECKPOINT_FORMAT
    #: The run stopped (an abort, or a budget: ``finish_reason`` says which): every call has its result, nothing
    #: moves it until a send or a resume.
    aborted: bool = False
    #: The run's input ended (finished, paused or stopped) and its ``on_run_end`` hooks have not all run yet.
    end_due: bool = False
    #: A dynamic agent's choice for the current input: the model's spec and where its context is (format 3).
    run_config: dict[str, Any] | None = None
    #: Limits that replace the agent's for this run, given to ``resume`` (format 3).
    limits: dict[str, Any] | None = None
    #: Seconds the current input has been running (pauses and stops left out) before ``clock_since`` (format 3).
    clock_spent_s: float | None = None
    #: When the run's clock last started (Postgres time); None while it is stopped (format 3).
    clock_since: datetime | None = None
    #: Metadata sent with the input the run works on (``send(..., metadata=...)``; format 3).
    metadata: dict[str, Any] | None = None
    #: The fairness key of the input (``send(..., fairness_key=...)``): waits for a model slot go round-robin by it.
    fairness_key: str | None = None
    #: The agent the run was handed to (``transfer_to_<name>``); None while it is on ``agent`` (format 3).
    active_agent: str | None = None
    #: Calls of the last turn delegated to child runs: call id -> child run id (format 3).
    delegated: dict[str, str] | None = None
    #: The current input's trace context (``worker.tracing``), made by the step that merged it (format 3).
    trace: str | None = Field(default=None, max_length=512)
    #: Some delegated call has no result yet: the run has no step due until a child settles.
    waiting: bool = False
    #: A child run's lead's agent: its hooks run in the child too (format 3).
    lead_agent: str | None = None
    #: Child runs started as background tasks of the current input (format 3).
    background: list[str] | None = None

    @field_validator("updated_at", "next_attempt_at", "retry_since", "clock_since")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("timestamps must be timezone-aware")
        return value

    def document(self) -> dict[str, Any]:
        """The part stored as the checkpoint's JSON body in format 1 (control fields live in columns)."""
        return self.model_dump(mode="json", exclude=_COLUMN_FIELDS, exclude_none=True)

    def control_document(self) -> dict[str, Any]:
        """``document()`` without the transcript: the run's document in format 2 (messages are rows)."""
        return self.model_dump(mode="json", exclude=_COLUMN_FIELDS | {"messages"}, exclude_none=True)

    @property
    def current_agent(self) -> str:
        """The agent the run is on now: the one it was handed to, else its own."""
        return self.active_agent or self.agent

    @property
    def pending_tool_calls(self) -> list[ToolCall]:
        """Calls of the last assistant turn that have no result yet, in call order."""
        for index in range(len(self.messages) - 1, -1, -1):
            message = self.messages[index]
            if message.role == "assistant":
                if not message.tool_calls:
                    return []
                answered = {m.tool_call_id for m in self.messages[index + 1 :] if m.role == "tool"}
                return [call for call in message.tool_calls if call.id not in answered]
        return []

    def with_tool_result(self, result: Message) -> Checkpoint:
        """This checkpoint with ``result`` placed at its call's position among the last turn's results.

        Results settle in any order; keeping them sorted by call order makes the transcript valid
        as soon as the last one lands. A second result for the same call is ignored.

        Raises:
            ValueError: the last assistant turn has no call with that id.
        """
        messages = list(self.messages)
        turn_index = len(messages) - 1  # the last assistant turn: searched from the end, a run can be long
        while turn_index >= 0 and messages[turn_index].role != "assistant":
            turn_index -= 1
        if turn_index < 0:
            raise ValueError("no assistant turn to place a result after")
        order = {c.id: k for k, c in enumerate(messages[turn_index].tool_calls or ())}
        if result.tool_call_id not in order:
            raise ValueError(f"result for unknown call {result.tool_call_id!r}")
        position = turn_index + 1
        while position < len(messages) and messages[position].role == "tool":
            if messages[position].tool_call_id == result.tool_call_id:
                return self
            if order.get(messages[position].tool_call_id or "", -1) > order[result.tool_call_id]:
                break
            position += 1
        messages.insert(position, result)
        started = [c for c in self.started_tool_call_ids if c != result.tool_call_id]
        return self.model_copy(update={"messages": messages, "started_tool_call_ids": started})

    @property
    def run_tool_calls(self) -> list[ToolCall]:
        """Every call made since the current run started."""
        return [c for m in self.messages[self.run_start :] if m.role == "assistant" for c in m.tool_calls or ()]

    @property
    def final_text(self) -> str | None:
        """The last assistant text of the transcript."""
        for message in reversed(self.messages):
            if message.role == "assistant" and isinstance(message.content, str) and message.content:
                return message.content
        return None


ApprovalStatus = Literal["pending", "approved", "rejected", "withdrawn"]
ApprovalKind = Literal["tool", "question", "reconcile"]


class Approval(_Record):
    """A gated tool call waiting for (or given) a human decision."""

    approval_id: str
    session_id: str
    tool_call_id: str
    tool_name: str
    args: dict[str, Any] = Field(default_factory=dict)
    agent: str
    status: ApprovalStatus = "pending"
    note: str | None = None
    fingerprint: dict[str, Any] | None = None
    created_at: datetime | None = None
    decided_at: datetime | None = None
    #: ``tool``: a gated call, approved or rejected; ``question``: ``ask_question``, answered or declined;
    #: ``reconcile``: a ``once`` call its worker died in, run again (approved), not done (rejected) or answered.
    kind: ApprovalKind = "tool"
    #: What a person is asked: a question's text, or why a reconciliation needs a person.
    question: str | None = None
    options: list[str] | None = None
    #: A question's answer (the call's result is ``{"answer": answer}``), or a reconciled call's result.
    answer: str | None = None
    #: Past this time (Postgres's clock) the approval counts as rejected; None: it never expires.
    expires_at: datetime | None = None
    #: Seconds from creation to ``expires_at``; given when the approval is opened, never stored.
    expires_in: float | None = Field(default=None, exclude=True)

    @property
    def run_path(self) -> list[str]:
        """The runs that lead to this approval, outermost first: its run's leads, then its run (sub-agents)."""
        return runs_to(self.session_id)


class Progress(_Record):
    """Where a run stands, without its transcript (what a waiting producer polls)."""

    status: Status
    inbox_cursor: int
    #: The number of the latest input sent to the run (``inbox_cursor`` reaches it once every input is merged).
    inbox_head: int = 0
    last_error: LastError | None = None
    #: The run stopped on an abort (it is in progress, waiting for a send or a resume).
    aborted: bool = False
    #: The seq the run's next durable event gets.
    events_next: int = 0
    finish_reason: str | None = None
    #: The run's agent (the one it was sent to).
    agent: str | None = None


#: Key of an inbox row's stored metadata object that carries the business state sent with the input
#: (``send(..., business_state=...)``); senders may not use it in their own metadata.
BUSINESS_STATE_KEY = "lousho.business_state"
#: Key of an inbox row's stored metadata object that carries the fairness key sent with the input.
FAIRNESS_KEY = "lousho.fairness_key"


class InboxEntry(_Record):
    """One ``send`` waiting to be merged into its run at the next step boundary."""

    n: int
    messages: list[Message]
    #: What the sender attached for the application's code (``send(..., metadata=...)``); never sent to a model.
    metadata: dict[str, Any] | None = None
    #: The business state sent with the input (``send(..., business_state=...)``); None leaves the run's as it is.
    business_state: Any = None
    #: The fairness key sent with the input; None leaves the run's as it is.
    fairness_key: str | None = None

    @classmethod
    def from_stored(cls, n: int, messages: Any, stored: dict[str, Any] | None) -> InboxEntry:
        """The entry of an inbox row whose ``metadata`` column may carry the business state and fairness key."""
        if not stored or (BUSINESS_STATE_KEY not in stored and FAIRNESS_KEY not in stored):
            return cls(n=n, messages=messages, metadata=stored)
        metadata = {key: value for key, value in stored.items() if key not in (BUSINESS_STATE_KEY, FAIRNESS_KEY)}
        fairness = stored.get(FAIRNESS_KEY)
        return cls(
            n=n,
            messages=messages,
            metadata=metadata or None,
            business_state=stored.get(BUSINESS_STATE_KEY),
            fairness_key=fairness if isinstance(fairness, str) else None,
        )


class HistoryEntry(_Record):
    """One saved state of a run, as kept by the per-run history ring."""

    step: int
    seq: int
    saved_at: datetime
    status: Status
    checkpoint: Checkpoint


def run_state(
    status: Status,
    last_error: LastError | None,
    next_attempt_at: datetime | None = None,
    *,
    waiting: bool = False,
    own_approvals: bool = True,
) -> RunState:
    """Where an unfinished run stands (one that was not stopped by an abort or a budget).

    ``awaiting-approval`` on decisions of a person, except a lead whose pause is only its children's
    (``waiting`` and no approval of its ``own_approvals``): it is ``waiting``, as while its children run. Then
    ``parked`` by an error that needs a person, ``retrying`` after a transient failure, ``waiting`` on children,
    else ``running`` (moving, or about to).
    """
    if status == "awaiting-approval":
        return "waiting" if waiting and not own_approvals else "awaiting-approval"
    if last_error is not None and not last_error.retryable:
        return "parked"
    if last_error is not None or next_attempt_at is not None:
        return "retrying"
    return "waiting" if waiting else "running"


class PendingRun(_Record):
    """A run that is not finished, with where it stands (``state``, a ``RunState``).

    A finished run whose follow-up input has not been applied (still queued, or failed) is listed too.
    """

    session_id: str
    kind: Literal["run"] = "run"
    checkpoint_id: str
    status: Status
    approval_id: str | None = None
    approval_kind: str | None = None
    step: int
    last_error: LastError | None = None
    #: Steps of the run that started and never ended (a crash, a kill) in a row; ``LOUSHO_MAX_ATTEMPTS`` parks it.
    attempts: int = 0
    agent: str
    state: RunState = "running"
    #: When a run that failed transiently is tried again (``state`` ``retrying``); None otherwise.
    next_attempt_at: datetime | None = None
    #: Transient failures in a row (a provider 5xx or 429, a timeout) since the run last saved progress.
    failures: int = 0

    @property
    def lead(self) -> str | None:
        """The run whose sub-agent this run is (None for a run of its own): ``pending()`` lists it under its lead."""
        return lead_of(self.session_id)


def checkpoint_state(checkpoint: Checkpoint, *, queued: bool = False, own_approvals: bool = True) -> RunState:
    """Where an unfinished run saved as ``checkpoint`` stands: ``run_state``, or how it stopped (budget, abort).

    ``queued``: input sent to the run waits to be merged (a stopped run with input has work again);
    ``own_approvals``: some approval the run pauses on is its own, not a child's.
    """
    if checkpoint.aborted and not queued and not checkpoint.end_due:
        return _stopped_state(checkpoint.finish_reason)
    return run_state(
        checkpoint.status,
        checkpoint.last_error,
        checkpoint.next_attempt_at,
        waiting=checkpoint.waiting,
        own_approvals=own_approvals,
    )


def _stopped_state(finish_reason: str | None) -> RunState:
    """How a run stopped by an abort or a budget stands (its finish reason says which)."""
    return "budget-exceeded" if finish_reason == "budget-exceeded" else "aborted"


def listed_state(
    status: Status,
    aborted: bool,
    finish_reason: str | None,
    last_error: LastError | None,
    next_attempt_at: datetime | None,
    *,
    waiting: bool = False,
    queued: bool = False,
    end_due: bool = False,
    own_approvals: bool = True,
) -> ListedState:
    """Where a run stands, from its row's columns: the one rule of every listing, ``pending()`` and ``describe``.

    ``finished`` and the stopped states (``aborted``, ``budget-exceeded``) only while the run has no work: input
    ``queued`` after it, or ``on_run_end`` hooks owed (``end_due``), make it ``running`` again. ``finish_reason``
    is read only for a stopped run, ``own_approvals`` only for a lead paused while it waits on children;
    ``store.listing.STATE`` is this rule in SQL.
    """
    idle = not queued and not end_due
    if status == "finished" and not aborted and idle:
        return "finished"
    if aborted and idle:
        return _stopped_state(finish_reason)
    return run_state(status, last_error, next_attempt_at, waiting=waiting, own_approvals=own_approvals)


def canonical_states(states: Iterable[str]) -> set[str]:
    """``states`` with the words of an earlier release (``STATE_ALIASES``) read as the states they stand for."""
    return {STATE_ALIASES.get(state, state) for state in states}


class ListedRun(_Record):
    """A run as a listing shows it: where it stands and when, without its transcript or document."""

    session_id: str
    agent: str
    state: ListedState
    status: Status
    #: The lead of a sub-agent run (None for a run of its own).
    parent_id: str | None = None
    created_at: datetime
    updated_at: datetime
    last_error: LastError | None = None
    #: Crash restarts of the current step (the poison-pill count), and transient failures in a row.
    attempts: int = 0
    failures: int = 0
    next_attempt_at: datetime | None = None
    #: From the run's document: read only when a listing asks for details (``list_runs(details=True)``).
    finish_reason: str | None = None
    step: int | None = None
    usage: Usage | None = None


class RunsPage(_Record):
    """A page of a runs listing, newest first, with the cursors of the pages on either side of it.

    ``next_cursor`` continues toward older runs and ``prev_cursor`` back toward newer ones; None when there is
    nothing that way (``prev_cursor`` is None on a first page, whatever was created since it was read).
    """

    items: list[ListedRun]
    next_cursor: str | None = None
    prev_cursor: str | None = None


def pending_run(
    checkpoint: Checkpoint, approval_kind: str | None = None, *, queued: bool = False, own_approvals: bool = True
) -> PendingRun:
    """How ``pending()`` shows an unfinished run; ``approval_kind`` is the kind of its first approval, if known.

    ``queued`` and ``own_approvals`` as for ``checkpoint_state``.
    """
    paused = checkpoint.status == "awaiting-approval" and bool(checkpoint.approval_ids)
    return PendingRun(
        session_id=checkpoint.session_id,
        checkpoint_id=checkpoint.session_id,
        status=checkpoint.status,
        approval_id=checkpoint.approval_ids[0] if paused else None,
        approval_kind=(approval_kind or "tool") if paused else None,
        step=checkpoint.step,
        last_error=checkpoint.last_error,
        attempts=checkpoint.attempts,
        agent=checkpoint.agent,
        state=checkpoint_state(checkpoint, queued=queued, own_approvals=own_approvals),
        next_attempt_at=checkpoint.next_attempt_at,
        failures=checkpoint.failures,
    )


def unreadable_run(
    session_id: str,
    agent: str,
    status: Status,
    attempts: int,
    error: errors.CheckpointCorruptError | errors.CheckpointFormatError,
    next_attempt_at: datetime | None = None,
    *,
    listed: bool = False,
) -> PendingRun:
    """How a run whose checkpoint cannot be read is shown: parked with its error (``listed``: as ``list()`` shows it).

    ``pending()`` shows the row's own status and state; ``list()`` shows it in progress at step 0.
    """
    last_error = LastError(**error.to_record())
    if listed:
        return PendingRun(
            session_id=session_id,
            checkpoint_id=session_id,
            status="in-progress",
            step=0,
            last_error=last_error,
            attempts=attempts,
            agent=agent,
        )
    return PendingRun(
        session_id=session_id,
        checkpoint_id=session_id,
        status=status,
        step=0,
        last_error=last_error,
        attempts=attempts,
        agent=agent,
        state=run_state(status, last_error, next_attempt_at),
        next_attempt_at=next_attempt_at,
    )


def stored_checkpoint(
    session_id: str,
    columns: dict[str, Any],
    document: dict[str, Any],
    uncounted_usage: Any = None,
    messages: list[Message] | None = None,
) -> Checkpoint:
    """A run's stored columns and document as a checkpoint (the one reading of a stored run, in any store).

    ``messages`` is the transcript of a format-2 run, read from its rows (and not validated again); a
    format-1 document carries its own.

    Raises:
        CheckpointFormatError: the checkpoint was written in a newer format than this code reads.
        CheckpointCorruptError: the stored document cannot be read.
    """
    document = {k: v for k, v in document.items() if k not in ("session_id", "agent", "messages_count")}
    found_format = document.pop("format", 1)
    if isinstance(found_format, int) and found_format > READ_FORMATS[-1]:
        raise errors.CheckpointFormatError(session_id, found_format, READ_FORMATS[-1])
    try:
        checkpoint = Checkpoint(session_id=session_id, **columns, **document)
        if messages:
            checkpoint = checkpoint.model_copy(update={"messages": messages})
        if uncounted_usage:
            extra = Usage.model_validate(uncounted_usage)
            checkpoint = checkpoint.model_copy(update={"usage": checkpoint.usage + extra, "uncounted_usage": extra})
        return checkpoint
    except (ValueError, TypeError) as exc:
        raise errors.CheckpointCorruptError(f"checkpoint of run {session_id!r} cannot be read") from exc


class DueRun(_Record):
    """A run the recovery sweep may send a step for: silent too long, or due for a retry."""

    session_id: str
    seq: int
    agent: str
    #: True when the run waits for a retry after a transient failure (not a lost message).
    retrying: bool = False
    due: datetime


class SweptRun(_Record):
    """A run the recovery sweep sent on, as it came out: its input ended (recovered) or it failed again.

    Handed to an agent's ``on_recovered`` (``last_error`` None) or ``on_error`` (``last_error`` set) once per
    recovery (``store.checkpoints.PostgresCheckpointStore.settle_recoveries``).
    """

    session_id: str
    agent: str
    status: Status
    finish_reason: str | None = None
    #: Stopped by an abort or a budget (``finish_reason`` says which).
    aborted: bool = False
    #: Why the run failed after the sweep sent it on (None: it recovered).
    last_error: LastError | None = None


# -- what the stores exchange with their callers -------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """Result of claiming a run's fence: the run as loaded, or the fence that beat our token."""

    checkpoint: Checkpoint | None
    inbox_head: int = 0
    stored_fence: int | None = None
    #: The store's clock when the claim was made (retry budgets are measured against it, never a worker's).
    now: datetime | None = None
    #: An abort was requested and no step has settled it yet.
    abort_requested: bool = False
    #: The run is a sub-agent's whose lead is no longer stored (deleted or pruned): nothing will read its result.
    lead_gone: bool = False


class EventDraft(_Record):
    """A durable event a write makes true, before the store numbers it (``store.events``).

    ``message`` is the transcript entry the event is about (a model turn, a tool result): the store keeps a
    reference to its row rather than a second copy, and readers see it in the event's data.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    type: str
    data: dict[str, Any] = Field(default_factory=dict)
    message: Message | None = None


class StepWrite(_Record):
    """What one step adds to its run, handed to the store as one fenced write.

    ``checkpoint`` is the run as the step leaves it: its ``seq`` is the stored one plus one and its
    ``fence`` the step's token. The other fields say what the step added, so a store can write only
    that; a store may also write the whole checkpoint.
    """

    checkpoint: Checkpoint
    #: Index in ``checkpoint.messages`` of the first message this step added or changed: the ones before
    #: it are as the step loaded them. None when the step does not say (the whole transcript may differ).
    first_new_message: int | None = Field(default=None, ge=0)
    #: The step merged inbox entries up to ``checkpoint.inbox_cursor``: the store drops them.
    drained_inbox: bool = False
    #: Approvals the step opened (a pausing write): created with the write, never without it.
    approvals: tuple[Approval, ...] = ()
    #: Durable events the write makes true, numbered and stored with it (``store.events``).
    events: tuple[EventDraft, ...] = ()
    #: The write settles an abort request: the run stops as aborted and the request is cleared.
    settles_abort: bool = False
    #: The step began on a run paused on approvals. If their last decision continued the run while the step held
    #: its lease (the stored run is in progress again), a write that leaves it paused keeps it in progress: the
    #: step read the approvals before the decision, and must not undo it.
    paused_before: bool = False

    @property
    def new_messages(self) -> list[Message]:
        """The messages this step added or changed (the whole transcript when it does not say)."""
        return self.checkpoint.messages[self.first_new_message or 0 :]


@dataclass(frozen=True)
class Decision:
    """What a resolve did: the approval as decided, and whether its run may continue now."""

    approval: Approval
    run_continues: bool


@dataclass
class Lease:
    """A lease held on one run; ``lost`` is set when a renewal found another owner.

    Taking and renewing it also reads the run's signals: whether a consumer watches its events, an abort
    doorbell, and the inbox number of the latest steer. ``wake`` is set whenever one of them arrives.
    """

    session_id: str
    owner: str
    token: int
    lost: threading.Event = field(default_factory=threading.Event)
    #: A consumer reads the run's events: steps publish live signals and new-event notes.
    watched: bool = False
    #: The abort doorbell rang (the step checks the request in Postgres before acting on it).
    abort: threading.Event = field(default_factory=threading.Event)
    #: Inbox number of the latest steer heard (0: none).
    steer: int = 0
    #: Set when ``lost``, ``abort`` or a new ``steer`` arrives, so a waiting step looks again.
    wake: threading.Event = field(default_factory=threading.Event)

    def hear(self, watched: bool, abort: bool, steer: int) -> None:
        """Take in the signals an acquisition or renewal read."""
        self.watched = watched
        if abort and not self.abort.is_set():
            self.abort.set()
            self.wake.set()
        if steer > self.steer:
            self.steer = steer
            self.wake.set()


@dataclass(frozen=True)
class Serving:
    """One live worker's registration of an agent."""

    worker_id: str
    fingerprint: dict[str, Any]
    formats: list[int]

    def has_tools(self, names: Iterable[str]) -> bool:
        """Whether this worker's version of the agent has every tool in ``names``."""
        tools = self.fingerprint.get("tools") or {}
        return all(name in tools for name in names)


#: How a webhook delivery was signed.
DeliverySource = Literal["standard-webhooks", "github"]


class Delivery(_Record):
    """One accepted webhook delivery and the run it started."""

    agent: str
    delivery_id: str
    session_id: str
    source: DeliverySource
    body_sha256: str
    received_at: datetime


@dataclass(frozen=True)
class Intake:
    """What recording a delivery did: ``created`` is False for a delivery seen before.

    ``replay_of`` is set when a GitHub delivery came under a new id with the signed body of an earlier
    one: ``delivery`` is then that earlier delivery, and nothing was written.
    """

    delivery: Delivery
    created: bool
    replay_of: str | None = None
