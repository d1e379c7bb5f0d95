"""``Client``, ``AgentHandle`` and ``Run``: how work gets in and results get out, from any process.

Input is written to the run's inbox in Postgres before ``advance`` is enqueued, so a send is
never lost: a lost message is repaired by the recovery sweep.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict
from sqlalchemy import Engine

from producer import forks
from producer.enqueue import Enqueuer
from producer.forks import Fork
from producer.schedules import Schedules
from store import errors, inputs, interfaces, records
from store.approvals import PostgresApprovalStore
from store.checkpoints import PostgresCheckpointStore
from store.database import make_engine
from store.faults import crash_point
from store.inputs import Input, normalize_input
from store.leases import LeaseManager
from store.records import Approval, Checkpoint, HistoryEntry, Message, PendingRun, ToolCall, Usage
from store.settings import Settings, load_settings

log = logging.getLogger("lousho.client")
_KNOWN_AGENTS_TTL_S = 5.0


class RunResult(BaseModel):
    """How a run settled: finished (``stop``/``max-steps``) or paused (``awaiting-approval``)."""

    model_config = ConfigDict(frozen=True)

    session_id: str
    finish_reason: str | None
    text: str | None
    messages: list[Message]
    steps: int
    usage: Usage
    tool_calls: list[ToolCall]
    approval_id: str | None = None
    approval_ids: list[str] = []

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> RunResult:
        """The result a settled checkpoint describes."""
        finish = checkpoint.finish_reason or ("awaiting-approval" if checkpoint.status == "awaiting-approval" else None)
        return cls(
            session_id=checkpoint.session_id, finish_reason=finish, text=checkpoint.final_text,
            messages=list(checkpoint.messages), steps=checkpoint.step, usage=checkpoint.usage,
            tool_calls=checkpoint.run_tool_calls,
            approval_id=checkpoint.approval_ids[0] if checkpoint.approval_ids else None,
            approval_ids=list(checkpoint.approval_ids),
        )


class Run:
    """A handle on one send or resume; ``wait`` returns its result or raises its error."""

    def __init__(self, client: Client, session_id: str, input_number: int) -> None:
        self._client = client
        self.session_id = session_id
        self.input_number = input_number

    def wait(self, timeout: float = 30.0, poll_interval: float = 0.05) -> RunResult:
        """Block until the run settles with this input applied.

        Raises:
            RunTimeoutError: it did not settle within ``timeout`` seconds (it goes on).
            CheckpointNotFoundError: the run was deleted meanwhile.
            LoushoError: the typed error the run was parked with (non-retryable).
        """
        deadline = time.monotonic() + timeout
        interval = min(poll_interval, 0.02)
        store = self._client.store
        while True:
            # Poll the control columns only; the transcript is read once, when the run settled.
            progress = store.progress(self.session_id)
            if progress is None:
                raise errors.CheckpointNotFoundError(f"run {self.session_id!r} is not stored")
            if progress.last_error is not None and not progress.last_error.retryable:
                raise errors.from_record(progress.last_error.model_dump())
            if progress.inbox_cursor >= self.input_number and progress.status != "in-progress":
                checkpoint = store.load(self.session_id)
                if checkpoint is None:
                    raise errors.CheckpointNotFoundError(f"run {self.session_id!r} is not stored")
                return RunResult.of(checkpoint)
            if time.monotonic() >= deadline:
                raise errors.RunTimeoutError(f"run {self.session_id!r} did not settle within {timeout} s")
            time.sleep(interval)
            interval = min(interval * 1.5, poll_interval * 4)

    def __repr__(self) -> str:
        return f"Run({self.session_id!r})"


class Client:
    """Entry point for producers: ``Client().agent("shop").send(...)``."""

    def __init__(self, settings: Settings | None = None, *, engine: Engine | None = None) -> None:
        self.settings = settings or load_settings()
        self._engine = engine
        #: Whether ``close`` disposes of the engine (made here, not given).
        self._owns_engine = engine is None
        self._store: interfaces.ProducerStore | None = None
        self._redis: redis.Redis | None = None
        self._leases: interfaces.Leases | None = None
        self._enqueuer: Enqueuer | None = None
        self._known: tuple[float, list[str]] = (0.0, [])

    @property
    def engine(self) -> Engine:
        """The SQL engine of the client's Postgres stores (made on first use unless one was given)."""
        if self._engine is None:
            self._engine = make_engine(self.settings)
        return self._engine

    @property
    def store(self) -> interfaces.ProducerStore:
        """The checkpoint store (connects on first use)."""
        if self._store is None:
            self._store = PostgresCheckpointStore(self.engine, self.settings.history_limit)
        return self._store

    @property
    def leases(self) -> interfaces.Leases:
        """Read access to run leases (to refuse a resume of a live run)."""
        if self._leases is None:
            self._redis = redis.Redis.from_url(self.settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
            self._leases = LeaseManager(self._redis, self.settings.lease_ttl_ms)
        return self._leases

    @property
    def enqueuer(self) -> Enqueuer:
        """The step-message publisher."""
        if self._enqueuer is None:
            self._enqueuer = Enqueuer(self.settings)
        return self._enqueuer

    @property
    def approvals(self) -> Approvals:
        """Pending approvals of every agent, and their decisions."""
        return Approvals(self, None)

    @property
    def schedules(self) -> Schedules:
        """Schedules stored in Postgres: create, list, pause, resume, delete (``producer.schedules``)."""
        return Schedules(self)

    def agent(self, name: str) -> AgentHandle:
        """A handle for sending to and inspecting the runs of agent ``name``."""
        return AgentHandle(self, records.validate_agent_name(name))

    def known_agents(self) -> list[str]:
        """Agents registered by workers (cached for a few seconds)."""
        stamp, names = self._known
        if time.monotonic() - stamp > _KNOWN_AGENTS_TTL_S:
            names = self.store.known_agents()
            self._known = (time.monotonic(), names)
        return names

    def pending(self, agent: str | None = None) -> list[PendingRun]:
        """Runs that are not finished, of one agent or all.

        Each comes with its ``state``: running, retrying (with ``next_attempt_at``), parked on an error
        (``last_error``), or paused.
        """
        return self.store.pending(agent)

    def resume(self, session_id: str) -> Run | None:
        """Finish an interrupted run of any agent; None when nothing is pending.

        Raises:
            SessionIdInvalidError, SessionAwaitingApprovalError, SessionBusyError.
        """
        records.validate_session_id(session_id)
        checkpoint = self.store.load(session_id)
        if checkpoint is None:
            return None
        return self._resume(checkpoint)

    def _resume(self, checkpoint: Checkpoint) -> Run | None:
        session_id = checkpoint.session_id
        if checkpoint.status == "awaiting-approval":
            approval = checkpoint.approval_ids[0] if checkpoint.approval_ids else None
            raise errors.SessionAwaitingApprovalError(session_id, approval)
        if self.leases.holder(session_id) is not None:
            raise errors.SessionBusyError(session_id)
        # A parked run: the caller fixed the cause (that is what resuming it means). A retrying run:
        # try now rather than at its next attempt time. None: finished, with no input left to apply.
        if self.store.reset_attempts(session_id) is None:
            return None
        self.nudge(session_id, agent=checkpoint.agent)
        return Run(self, session_id, checkpoint.inbox_cursor)

    def nudge(self, session_id: str, agent: str | None = None) -> None:
        """Ask a worker to advance a run whose input or decision is already durable.

        A broker that cannot be reached is logged, not raised: the recovery sweep sends the step
        once the run has been quiet for a lease TTL, so nothing committed is lost.
        """
        try:
            self.enqueuer.advance(session_id, agent=agent)
        except errors.StorageError as exc:
            log.warning("could not enqueue a step for %s (%s); the recovery sweep will send it",
                        session_id, exc.message)

    def close(self) -> None:
        """Close connections."""
        if self._enqueuer is not None:
            self._enqueuer.close()
        if self._redis is not None:
            self._redis.close()
        if self._owns_engine and self._engine is not None:
            self._engine.dispose()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Approvals:
    """Human decisions on gated tool calls, from any process, hours or days later."""

    def __init__(self, client: Client, agent: str | None) -> None:
        self._client = client
        self._agent = agent
        self._store: interfaces.ApprovalStore = PostgresApprovalStore(client.engine)

    def list(self) -> list[Approval]:
        """Undecided approvals (session, call id, tool name, arguments, created at), oldest first."""
        return self._store.pending(self._agent)

    def resolve(self, approval_id: str, approved: bool, note: str | None = None) -> Run:
        """Decide an approval. When it is the last pending one of its pause, the run continues.

        Returns a ``Run`` whose ``wait`` gives the run's next settled state (another pause, or the end).

        Raises:
            ApprovalNotFoundError: unknown, already decided, or of another agent.
            ApprovalOrphanedError: the run was deleted or replaced; the approval is withdrawn and nothing runs.
        """
        if not isinstance(approval_id, str) or not approval_id or len(approval_id) > 200:
            raise errors.ApprovalNotFoundError(f"approval {str(approval_id)[:80]!r} is unknown")
        if self._agent is not None:
            found = self._store.by_ids([approval_id]).get(approval_id)
            if found is None or found.agent != self._agent:
                raise errors.ApprovalNotFoundError(f"approval {approval_id!r} is unknown to agent {self._agent!r}")
        decision = self._store.resolve(approval_id, approved, note)
        session_id = decision.approval.session_id
        checkpoint = self._client.store.load(session_id)
        cursor = checkpoint.inbox_cursor if checkpoint is not None else 0
        continue_after(decision, lambda sid, agent: self._client.nudge(sid, agent=agent))
        return Run(self._client, session_id, cursor)


def continue_after(decision: records.Decision, send: Callable[[str, str], None]) -> None:
    """Send the run's next step when ``decision`` (committed) was the last one its pause waited on.

    The one rule of approve-then-enqueue, for ``Approvals.resolve`` and the HTTP intake's decisions: the
    decision is durable before anything is sent, and a lost send is repaired by the recovery sweep.
    """
    if decision.run_continues:
        crash_point("approval_decided_before_resume_enqueue", decision.approval.session_id)
        send(decision.approval.session_id, decision.approval.agent)


class AgentHandle:
    """Sends, resumes and inspects the runs of one agent."""

    def __init__(self, client: Client, name: str) -> None:
        self._client = client
        self.name = name

    @property
    def approvals(self) -> Approvals:
        """Pending approvals of this agent's runs, and their decisions."""
        return Approvals(self._client, self.name)

    def send(self, input: Input, session_id: str, *, idempotency_key: str | None = None,
             check_agent: bool = True) -> Run:
        """Queue input for the run ``session_id`` and ask a worker to advance it.

        A new id starts a run; an unfinished run resumes (pending calls first, input after
        their results; a parked run tries again); a finished run continues as a conversation.
        A send retried with the same ``idempotency_key`` (its response was lost) is applied once.

        Raises:
            SessionIdInvalidError: the id breaks the id rules (nothing is written).
            InputTooLargeError: the input is too large or too deep.
            AgentNotFoundError: workers registered agents and this name is not among them.
            SessionAwaitingApprovalError: the run waits on an approval.
            ConfigurationError: the idempotency key is not 1-200 printable characters.
        """
        records.validate_session_id(session_id)
        if idempotency_key is not None:
            _check_idempotency_key(idempotency_key)
        messages = normalize_input(input)
        if not messages:
            return self._resume_or_current(session_id)
        if check_agent:
            inputs.check_agent(self.name, self._client.known_agents())
        number = self._client.store.append_input(session_id, self.name, messages, idempotency_key)
        self._client.nudge(session_id, agent=self.name)
        return Run(self._client, session_id, number)

    def _resume_or_current(self, session_id: str) -> Run:
        """``send([])``: resume an unfinished run, or a handle on the settled one."""
        checkpoint = self._client.store.load(session_id)
        if checkpoint is None:
            raise errors.CheckpointNotFoundError(f"run {session_id!r} is not stored: send some input to start it")
        resumed = self._client._resume(checkpoint)
        return resumed or Run(self._client, session_id, checkpoint.inbox_cursor)

    def resume(self, session_id: str) -> Run | None:
        """Finish an interrupted run; None when nothing is pending.

        Raises:
            SessionAwaitingApprovalError: the run waits on an approval.
            SessionBusyError: the run is running right now elsewhere.
        """
        records.validate_session_id(session_id)
        checkpoint = self._client.store.load(session_id)
        if checkpoint is None or checkpoint.agent != self.name:
            return None
        return self._client._resume(checkpoint)

    def pending(self) -> list[PendingRun]:
        """Runs of this agent that are interrupted, running, or paused on an approval."""
        return self._client.pending(self.name)

    def load(self, session_id: str) -> Checkpoint | None:
        """The run's latest checkpoint."""
        return self._client.store.load(records.validate_session_id(session_id))

    def history(self, session_id: str, limit: int | None = None) -> list[HistoryEntry]:
        """Saved states of the run, newest first; ``[]`` for an unknown run."""
        return self._client.store.history(records.validate_session_id(session_id), limit)

    def fork(self, session_id: str, from_step: int, patch: dict[str, Any] | None = None,
             new_session_id: str | None = None) -> Fork:
        """A new run from the newest saved state of ``from_step``; resume the fork to run it.

        Raises:
            CheckpointNotFoundError: the step is not in the run's history (the message lists those kept).
            ConfigurationError: ``new_session_id`` is taken, or the patch is malformed.
        """
        return forks.fork(self._client.store, session_id, from_step, patch, new_session_id, agent=self.name)

    def delete(self, session_id: str, keep_history: bool = False) -> bool:
        """Drop the run's checkpoint (and history unless ``keep_history``)."""
        return self._client.store.delete(records.validate_session_id(session_id), keep_history=keep_history)


def _check_idempotency_key(key: object) -> None:
    if not isinstance(key, str) or not 1 <= len(key) <= 200 or not key.isprintable():
        raise errors.ConfigurationError("idempotency_key must be 1-200 printable characters")
