"""``Client``, ``AgentHandle`` and ``Run``: how work gets in and results get out, from any process.

Input is written to the run's inbox in Postgres before ``advance`` is enqueued, so a send is
never lost: a lost message is repaired by the recovery sweep.

Stays whole: ``Client``, ``AgentHandle`` and ``Run`` are one public API sharing connections and a lifecycle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import Executor
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine

from producer import forks, inspection, streams
from producer.enqueue import Enqueuer
from producer.forks import Fork
from producer.schedules import Schedules
from store import doctor as doctor_report
from store import errors, inputs, interfaces, observed, recordings, records, redis_client, telemetry
from store.approvals import PostgresApprovalStore
from store.checkpoints import PostgresCheckpointStore
from store.database import make_engine
from store.events import Event
from store.faults import crash_point
from store.inputs import Input, normalize_input
from store.leases import LeaseManager
from store.limits import Limits
from store.model_limit import LimitConflict
from store.recordings import Recording
from store.records import Approval, Checkpoint, HistoryEntry, PendingRun
from store.registry import PostgresAgentRegistry
from store.settings import Settings, load_settings
from store.signals import RedisSignals
from store.summaries import RunPage, RunSummary
from store.summaries import RunResult as RunResult  # re-exported: RunResult was defined here before

log = logging.getLogger("lousho.client")
_KNOWN_AGENTS_TTL_S = 5.0


class Run:
    """A handle on one send or resume; ``wait`` returns its result, ``events`` follows it as it goes."""

    def __init__(self, client: Client, session_id: str, input_number: int, events_from: int | None = None) -> None:
        self._client = client
        self.session_id = session_id
        self.input_number = input_number
        #: For a resume or a decision: the run's first event seq that belongs to this handle.
        self._events_from = events_from

    def events(self, after: int | None = None, timeout: float | None = None, live: bool = False) -> Iterator[Event]:
        """The run's durable events with a seq above ``after``, as they are saved, until the next ``run.done``.

        ``after`` None starts at this input's ``run.start`` (for a resume or a decision: at the first event
        after it). ``live`` interleaves live signals (``seq`` None: model text as it streams, tool starts).

        Raises:
            RunTimeoutError: ``timeout`` seconds passed first (the run goes on; iterate again with the last seq).
            CheckpointNotFoundError: the run was deleted.
        """
        return self._follow(after, timeout, live, None)

    def _follow(
        self, after: int | None, timeout: float | None, live: bool, stop: threading.Event | None
    ) -> Iterator[Event]:
        store = self._client.store
        starts: streams.StartFilter = None
        if after is None:
            if self._events_from is not None:
                after = self._events_from - 1
            else:
                # In this order: a run.start written after the lookup has a seq at or past ``next``.
                progress = store.progress(self.session_id)
                if progress is None:
                    raise errors.CheckpointNotFoundError(f"run {self.session_id!r} is not stored")
                start = store.input_start(self.session_id, self.input_number)
                if start is not None:
                    after = start - 1
                else:
                    after = progress.events_next - 1
                    number = self.input_number

                    def merged_it(event: Event) -> bool:
                        return event.type == "run.start" and int(event.data.get("input_number", 0)) >= number

                    starts = merged_it
        return streams.follow(
            store, self._client.signals, self.session_id, after, starts=starts, live=live, timeout=timeout, stop=stop
        )

    def events_async(
        self, after: int | None = None, timeout: float | None = None, live: bool = False
    ) -> AsyncIterator[Event]:
        """``events`` for ``async for`` (web servers): the reading and waiting happen in a thread.

        The thread stops within half a second once the loop stops iterating (a client went away).
        """
        return streams.follow_async(lambda stop: self._follow(after, timeout, live, stop))

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
            if progress.inbox_cursor >= self.input_number and (progress.status != "in-progress" or progress.aborted):
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
        self._redis: redis_client.Client | None = None
        self._broker: redis_client.Client | None = None
        self._leases: interfaces.Leases | None = None
        self._enqueuer: Enqueuer | None = None
        self._signals: RedisSignals | None = None
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
            self._leases = LeaseManager(self._redis_client(), self.settings.lease_ttl_ms)
        return self._leases

    @property
    def signals(self) -> RedisSignals:
        """The runs' Redis signals: event notes and live signals, abort doorbells, steer marks."""
        if self._signals is None:
            self._signals = RedisSignals(self._redis_client())
        return self._signals

    def _redis_client(self) -> redis_client.Client:
        if self._redis is None:
            self._redis = redis_client.connect(self.settings, socket_timeout=5, socket_connect_timeout=5)
        return self._redis

    def _broker_client(self) -> redis_client.Client:
        """A Redis connection to the broker (the Redis of leases when the broker is the same URL)."""
        if self.settings.broker == self.settings.redis_url:
            return self._redis_client()
        if self._broker is None:
            self._broker = redis_client.connect(
                self.settings, url=self.settings.broker, socket_timeout=5, socket_connect_timeout=5
            )
        return self._broker

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

        Each comes with its ``state`` (``records.RunState``): running, retrying (with ``next_attempt_at``), waiting
        on its children, awaiting-approval, parked on an error (``last_error``), aborted or budget-exceeded.
        """
        return self.store.pending(agent)

    def runs(
        self,
        agent: str | Iterable[str] | None = None,
        state: str | Iterable[str] | None = None,
        since: datetime | timedelta | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> RunPage:
        """A page of runs, finished ones included, newest first by creation, as ``RunSummary`` items.

        Filtered and paged by the store (keyset paging: runs created while pages are read do not move the pages
        that follow), reading no transcript. ``waiting_on`` and ``next_action`` are left None: ``describe`` says
        them for one run.

        Args:
            agent: only runs of this agent (or of these agents).
            state: only runs in this state (or these), ``records.ListedState``; ``paused`` still means
                ``awaiting-approval`` for one release.
            since: only runs created at or after this time (a ``timedelta``: this long ago).
            limit: most runs on the page, 1 to 500.
            cursor: the ``next_cursor`` (or ``prev_cursor``) of an earlier page.

        Raises:
            ConfigurationError: an unknown state, a limit out of range, a cursor no page gave, or a naive ``since``.
        """
        return inspection.runs(self.store, agent, state, since, limit, cursor)

    def describe(self, session_id: str) -> RunSummary | None:
        """Where run ``session_id`` stands and why it is not finished; None for an unknown run.

        The summary's ``waiting_on`` says what it waits on, as seen now: the worker holding its lease and how long
        ago it renewed it, a step message in the broker, its retry time, the approvals (its own, or its
        children's), its unsettled children, or that no live worker serves its agent. ``next_action`` says in words
        what will move it and when, or that a person must act and how.

        Raises:
            SessionIdInvalidError: the id breaks the id rules.
            StorageError: Postgres, Redis or the broker could not be read.
        """
        return inspection.describe(self.engine, self._redis_client(), self._broker_client(), self.settings, session_id)

    def limit_conflicts(self) -> list[LimitConflict]:
        """Model limit keys that live workers give different numbers, with the numbers that hold meanwhile.

        Workers of two releases during a deploy may disagree on a key: each set of numbers is listed with the
        workers giving it, and the fleet's slots hold the smallest number of each (``lousho limits``).

        Raises:
            StorageError: Postgres could not be read.
        """
        return PostgresAgentRegistry(self.engine).limit_conflicts(observed.registration_window_s(self.settings))

    def doctor(self, wait: bool = True) -> doctor_report.Report:
        """Check invariant I19: every unfinished run has an owner, a timer or a waiter (``lousho doctor``).

        Looks at every unfinished run nothing changed for a lease TTL plus a sweep interval. A run nothing
        explains is a suspect; with ``wait`` the check looks again a sweep interval later and reports the runs
        still unexplained, nothing having changed, in ``unexplained`` (each with what ``describe`` says of it).
        The verdict is kept in Postgres, where ``/metrics`` reads ``lousho_runs_unexplained``.

        Raises:
            StorageError: Postgres, Redis or the broker could not be read.
        """
        return inspection.check(self.engine, self._redis_client(), self._broker_client(), self.settings, wait)

    def run(self, session_id: str) -> Run | None:
        """A handle on run ``session_id``, wherever it was started (a send, a webhook, beat, ``lousho.start``).

        Its ``wait()`` waits until the latest input sent so far is answered; ``events()`` follows that input's
        events. None for an unknown run.

        Raises:
            SessionIdInvalidError: the id breaks the id rules.
        """
        progress = self.store.progress(records.validate_session_id(session_id))
        if progress is None:
            return None
        return Run(self, session_id, progress.inbox_head)

    def delete(self, session_id: str, keep_history: bool = False) -> bool:
        """Drop run ``session_id`` with its children, as ``AgentHandle.delete`` without naming its agent.

        Returns False when no such run is stored.

        Raises:
            SessionIdInvalidError: the id breaks the id rules.
        """
        return self.store.delete(records.validate_session_id(session_id), keep_history=keep_history)

    def events(
        self,
        session_id: str,
        after: int | None = None,
        *,
        live: bool = False,
        timeout: float | None = None,
        include_children: bool = False,
    ) -> Iterator[Event]:
        """Follow the run's durable events after seq ``after`` until the next ``run.done``, from any process.

        ``after`` None starts at the run's latest ``run.start``. See ``Run.events``. ``include_children``
        interleaves its sub-agents' durable events in time order, each tagged with ``data["subagent"]``
        (``name``, ``depth``, ``tool_call_id``, ``parent``) and keeping its own run id and seq (no live signals).

        Raises:
            SessionIdInvalidError, CheckpointNotFoundError, RunTimeoutError.
        """
        if include_children:
            return streams.follow_tree(self.store, session_id, self._start_after(session_id, after), timeout=timeout)
        return self._follow(session_id, after, live, timeout, None)

    def _start_after(self, session_id: str, after: int | None) -> int:
        """``after``, or (None) the seq before the run's latest ``run.start``."""
        records.validate_session_id(session_id)
        if after is not None:
            return after
        if self.store.progress(session_id) is None:
            raise errors.CheckpointNotFoundError(f"run {session_id!r} is not stored")
        start = self.store.latest_start(session_id)
        return -1 if start is None else start - 1

    def _follow(
        self, session_id: str, after: int | None, live: bool, timeout: float | None, stop: threading.Event | None
    ) -> Iterator[Event]:
        after = self._start_after(session_id, after)
        return streams.follow(self.store, self.signals, session_id, after, live=live, timeout=timeout, stop=stop)

    def events_async(
        self,
        session_id: str,
        after: int | None = None,
        *,
        live: bool = False,
        timeout: float | None = None,
        executor: Executor | None = None,
    ) -> AsyncIterator[Event]:
        """``events`` for ``async for`` (web servers): the reading and waiting happen in a thread.

        The thread stops within half a second once the loop stops iterating (a client went away). It comes
        from ``executor``, else the event loop's default executor (a few threads; a server that follows many
        runs at once passes a larger pool).
        """
        return streams.follow_async(lambda stop: self._follow(session_id, after, live, timeout, stop), executor)

    def export(self, session_id: str) -> Recording:
        """Run ``session_id`` written down for replay (``lousho export``): inputs, turns, results, decisions, children.

        Secret-shaped text is masked. ``worker.testing.replay`` (``lousho replay``) runs it through an agent again;
        ``.model_dump_json()`` is the file.

        Raises:
            CheckpointNotFoundError: no such run.
            SessionIdInvalidError: the id breaks the id rules.
        """
        checkpoint = self.store.load(records.validate_session_id(session_id))
        if checkpoint is None:
            raise errors.CheckpointNotFoundError(f"run {session_id!r} is not stored")
        events: list[Event] = []
        after = -1
        while page := self.store.read_events(session_id, after, 1000):
            events.extend(page)
            after = max(after, *(event.seq for event in page if event.seq is not None))
        approvals = PostgresApprovalStore(self.engine).by_ids(recordings.approval_ids(events))
        children = []
        started = [e.data.get("child_run_id") for e in events if e.type == "subagent.start"]
        for child in (run_id for run_id in started if isinstance(run_id, str)):
            try:
                children.append(self.export(child))
            except errors.CheckpointNotFoundError:
                continue  # pruned or deleted since: the lead's recording keeps the child's result

        return recordings.build(
            session_id,
            checkpoint.agent,
            events,
            checkpoint.messages,
            approvals.values(),
            children,
            fingerprint=checkpoint.fingerprint,
        )

    def read_events(self, session_id: str, after: int, limit: int = 500) -> list[Event]:
        """One page of the run's durable events after seq ``after``, without waiting."""
        return self.store.read_events(records.validate_session_id(session_id), after, min(max(limit, 1), 1000))

    def abort(self, session_id: str) -> bool:
        """Stop a run: True when an abort was requested, False when the run is finished (nothing to stop).

        The step holding the run hears it at its next lease renewal at the latest: it starts no more tool
        calls, running calls see ``ctx.cancelled`` and get a ``cancelled`` result unless they finish
        first, an in-flight model call is dropped, and the run rests in progress with
        ``finish_reason="aborted"`` until a send or a resume. A paused run's approvals are withdrawn.

        Raises:
            SessionIdInvalidError, CheckpointNotFoundError.
        """
        records.validate_session_id(session_id)
        if not self.store.request_abort(session_id):
            return False
        try:
            self.signals.ring_abort(session_id)
        except errors.StorageError as exc:
            # The request is durable: the running step sees it at its next save's claim, a new step at once.
            log.warning("could not ring the abort doorbell of %s (%s)", session_id, type(exc).__name__)
        checkpoint = self.store.load(session_id)
        self.nudge(session_id, agent=checkpoint.agent if checkpoint else None, kind=telemetry.ABORT)
        return True

    def resume(self, session_id: str, *, limits: Limits | None = None) -> Run | None:
        """Finish an interrupted or stopped run of any agent; None when nothing is pending.

        ``limits`` replace the agent's ``Limits`` for the run from then on (every dimension: one left None
        is unlimited), so a run stopped with ``finish_reason="budget-exceeded"`` continues under raised limits.

        Raises:
            SessionIdInvalidError, SessionAwaitingApprovalError, SessionBusyError.
            ConfigurationError: ``limits`` is not a ``Limits``.
        """
        records.validate_session_id(session_id)
        _check_limits(limits)
        checkpoint = self.store.load(session_id)
        if checkpoint is None:
            return None
        return self._resume(checkpoint, limits)

    def _resume(self, checkpoint: Checkpoint, limits: Limits | None = None) -> Run | None:
        session_id = checkpoint.session_id
        if checkpoint.status == "awaiting-approval":
            approval = checkpoint.approval_ids[0] if checkpoint.approval_ids else None
            raise errors.SessionAwaitingApprovalError(session_id, approval)
        if self.leases.holder(session_id) is not None:
            raise errors.SessionBusyError(session_id)
        progress = self.store.progress(session_id)
        # A parked run: the caller fixed the cause (that is what resuming it means). A retrying run:
        # try now rather than at its next attempt time. An aborted or budget-stopped run moves again. None:
        # finished, with no input left to apply.
        if self.store.reset_attempts(session_id, None if limits is None else limits.stored()) is None:
            return None
        self.nudge(session_id, agent=checkpoint.agent, kind=telemetry.RESUME_RUN)
        return Run(
            self,
            session_id,
            checkpoint.inbox_cursor,
            events_from=progress.events_next if progress is not None else None,
        )

    def nudge(self, session_id: str, agent: str | None = None, kind: str = telemetry.NEW_INPUT) -> None:
        """Ask a worker to advance a run whose input or decision is already durable.

        A broker that cannot be reached is logged, not raised: the recovery sweep sends the step
        once the run has been quiet for a lease TTL, so nothing committed is lost.
        """
        try:
            self.enqueuer.advance(session_id, agent=agent, kind=kind)
        except errors.StorageError as exc:
            log.warning(
                "could not enqueue a step for %s (%s); the recovery sweep will send it", session_id, exc.message
            )

    def close(self) -> None:
        """Close connections."""
        if self._enqueuer is not None:
            self._enqueuer.close()
        if self._redis is not None:
            self._redis.close()
        if self._broker is not None:
            self._broker.close()
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

    def resolve(
        self, approval_id: str, approved: bool | None = None, note: str | None = None, answer: str | None = None
    ) -> Run:
        """Decide an approval: approve or reject a gated call, answer or decline a question (``ask_question``).

        ``answer`` answers a question (the call's result is ``{"answer": answer}``); ``approved=False``
        declines it. A reconciliation (kind ``reconcile``: a ``once`` call its worker died in) is approved (the call
        runs again), rejected (it is recorded as not done, with the note) or answered (it took effect: ``answer`` is
        its result). When it is the last pending decision of its pause, the run continues.

        Returns a ``Run`` whose ``wait`` gives the run's next settled state (another pause, or the end).

        Raises:
            ApprovalNotFoundError: unknown, already decided, or of another agent.
            ApprovalExpiredError: it expired before this decision; it was recorded as rejected and the run goes on.
            ApprovalOrphanedError: the run was deleted or replaced; the approval is withdrawn and nothing runs.
            ConfigurationError: an answer for a tool call, a question approved without an answer, or no decision.
        """
        if not isinstance(approval_id, str) or not approval_id or len(approval_id) > 200:
            raise errors.ApprovalNotFoundError(f"approval {str(approval_id)[:80]!r} is unknown")
        if self._agent is not None:
            found = self._store.by_ids([approval_id]).get(approval_id)
            if found is None or found.agent != self._agent:
                raise errors.ApprovalNotFoundError(f"approval {approval_id!r} is unknown to agent {self._agent!r}")
        try:
            decision = self._store.resolve(approval_id, approved, note, answer)
        except errors.ApprovalExpiredError:
            # Recorded as the expiry's rejection, committed: the run goes on now, not at the next sweep.
            expired = self._store.by_ids([approval_id]).get(approval_id)
            if expired is not None:
                self._client.nudge(expired.session_id, agent=expired.agent, kind=telemetry.RESUME)
            raise
        session_id = decision.approval.session_id
        progress = self._client.store.progress(session_id)
        cursor = progress.inbox_cursor if progress is not None else 0
        continue_after(decision, lambda sid, agent: self._client.nudge(sid, agent=agent, kind=telemetry.RESUME))
        return Run(self._client, session_id, cursor, events_from=progress.events_next if progress else None)


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

    def send(
        self,
        input: Input,
        session_id: str,
        *,
        metadata: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        check_agent: bool = True,
        business_state: Any = None,
        fairness_key: str | None = None,
    ) -> Run:
        """Queue input for the run ``session_id`` and ask a worker to advance it.

        A new id starts a run; an unfinished run resumes (pending calls first, input after
        their results; a parked run tries again); a finished run continues as a conversation.
        A send retried with the same ``idempotency_key`` (its response was lost) is applied once,
        with the first send's metadata.

        ``metadata`` (a JSON object, at most 16 KiB) rides with the input for the application's code: a
        dynamic agent's ``resolve`` and hooks read it; it is never shown to the model, nor logged.
        ``business_state`` (JSON, at most 64 KiB; None leaves it as it is) replaces the run's business state when
        the step that takes this input saves it (a ``business_state.changed`` event says so); tools and hooks read
        it from then on. ``fairness_key`` (a tenant, say; None leaves the run's as it is) shares contended model
        slots out round-robin by key (weighted by ``LOUSHO_FAIRNESS_WEIGHTS``), so one key's backlog cannot starve
        another's.

        Raises:
            SessionIdInvalidError: the id breaks the id rules (nothing is written).
            InputTooLargeError: the input or the metadata is too large or too deep, or the run has no room left
                for it: with its transcript and its queued input, this input would leave less than a reply's room
                under the checkpoint limit (nothing is written; the message names the way out, a fork with
                trimmed messages).
            AgentNotFoundError: workers registered agents and this name is not among them.
            SessionAwaitingApprovalError: the run waits on an approval.
            ConfigurationError: the idempotency key is not 1-200 printable characters, the metadata is
                not a JSON object, the business state is not JSON, or the fairness key is not 1-128 letters, digits,
                ``.``, ``_``, ``:``, ``@`` or ``-`` (nothing is written).
        """
        records.validate_session_id(session_id)
        if records.is_child_id(session_id):
            raise errors.SessionIdInvalidError(session_id, "ends with .task-<16 hex>, the mark of sub-agent runs")
        if idempotency_key is not None:
            _check_idempotency_key(idempotency_key)
        messages = normalize_input(input)
        if not messages:
            if metadata is not None or business_state is not None or fairness_key is not None:
                raise errors.ConfigurationError(
                    "metadata and business_state ride with input: send some input with them"
                )
            return self._resume_or_current(session_id)
        if check_agent:
            inputs.check_agent(self.name, self._client.known_agents())
        number = self._client.store.append_input(
            session_id, self.name, messages, idempotency_key, metadata, business_state, fairness_key
        )
        self._client.nudge(session_id, agent=self.name)
        return Run(self._client, session_id, number)

    def stream(
        self,
        input: Input,
        session_id: str,
        *,
        metadata: dict[str, Any] | None = None,
        live: bool = False,
        timeout: float | None = None,
    ) -> Iterator[Event]:
        """Send ``input`` (with ``metadata``, as ``send``) and follow the run's events until it settles.

        The run is marked watched before the send, so its first step already publishes live signals.

        Raises:
            The errors of ``send`` (nothing is written).
        """
        records.validate_session_id(session_id)
        try:
            self._client.signals.watch(session_id, streams.WATCH_TTL_MS)
        except errors.StorageError as exc:
            log.debug("could not mark %s watched (%s)", session_id, type(exc).__name__)
        return self.send(input, session_id, metadata=metadata).events(live=live, timeout=timeout)

    def events(
        self,
        session_id: str,
        after: int | None = None,
        *,
        live: bool = False,
        timeout: float | None = None,
        include_children: bool = False,
    ) -> Iterator[Event]:
        """Follow the run's events after seq ``after`` (None: from its latest ``run.start``), from any process.

        ``include_children``: its sub-agents' events too, tagged (``Client.events``).
        """
        return self._client.events(session_id, after, live=live, timeout=timeout, include_children=include_children)

    def events_async(
        self, session_id: str, after: int | None = None, *, live: bool = False, timeout: float | None = None
    ) -> AsyncIterator[Event]:
        """``events`` for ``async for`` (web servers)."""
        return self._client.events_async(session_id, after, live=live, timeout=timeout)

    def abort(self, session_id: str) -> bool:
        """Stop the run (see ``Client.abort``); False when it is finished."""
        return self._client.abort(session_id)

    def steer(self, session_id: str, message: Input, *, metadata: dict[str, Any] | None = None) -> Run:
        """Redirect the run with ``message`` at its next safe point.

        Calls of the current turn that have not started do not start: they get a result saying the user
        redirected the run, or, when the turn pauses for approvals, run after the last decision. A model
        call that has not emitted anything yet is cut short and asked again with the message. On an idle
        or finished run this is a send. ``metadata`` rides with the message, as with ``send``.

        Raises:
            SessionAwaitingApprovalError: the run waits on an approval (decide it first).
            SessionIdInvalidError, InputTooLargeError, AgentNotFoundError, ConfigurationError.
        """
        run = self.send(message, session_id, metadata=metadata)
        try:
            self._client.signals.mark_steer(session_id, run.input_number)
        except errors.StorageError as exc:
            # The message is queued either way: without the mark it waits for the turn's calls to finish.
            log.warning(
                "could not mark the steer of %s (%s); it applies after the running turn", session_id, type(exc).__name__
            )
        return run

    def _resume_or_current(self, session_id: str) -> Run:
        """``send([])``: resume an unfinished run, or a handle on the settled one."""
        checkpoint = self._client.store.load(session_id)
        if checkpoint is None:
            raise errors.CheckpointNotFoundError(f"run {session_id!r} is not stored: send some input to start it")
        resumed = self._client._resume(checkpoint)
        return resumed or Run(self._client, session_id, checkpoint.inbox_cursor)

    def resume(self, session_id: str, *, limits: Limits | None = None) -> Run | None:
        """Finish an interrupted or stopped run; None when nothing is pending.

        ``limits`` replace the agent's for the run from then on (see ``Client.resume``): a run stopped with
        ``finish_reason="budget-exceeded"`` continues under raised limits.

        Raises:
            SessionAwaitingApprovalError: the run waits on an approval.
            SessionBusyError: the run is running right now elsewhere.
            ConfigurationError: ``limits`` is not a ``Limits``.
        """
        records.validate_session_id(session_id)
        _check_limits(limits)
        checkpoint = self._client.store.load(session_id)
        if checkpoint is None or checkpoint.agent != self.name:
            return None
        return self._client._resume(checkpoint, limits)

    def pending(self) -> list[PendingRun]:
        """Runs of this agent that are interrupted, running, or paused on an approval."""
        return self._client.pending(self.name)

    def load(self, session_id: str) -> Checkpoint | None:
        """The run's latest checkpoint."""
        return self._client.store.load(records.validate_session_id(session_id))

    def history(self, session_id: str, limit: int | None = None) -> list[HistoryEntry]:
        """Saved states of the run, newest first; ``[]`` for an unknown run."""
        return self._client.store.history(records.validate_session_id(session_id), limit)

    def fork(
        self, session_id: str, from_step: int, patch: dict[str, Any] | None = None, new_session_id: str | None = None
    ) -> Fork:
        """A new run from the newest saved state of ``from_step``; resume the fork to run it.

        Raises:
            CheckpointNotFoundError: the step is not in the run's history (the message lists those kept).
            ConfigurationError: ``new_session_id`` is taken, or the patch is malformed.
            SessionIdInvalidError: ``new_session_id`` breaks the id rules or is a sub-agent run's id.
        """
        return forks.fork(self._client.store, session_id, from_step, patch, new_session_id, agent=self.name)

    def delete(self, session_id: str, keep_history: bool = False) -> bool:
        """Drop the run's checkpoint (and history unless ``keep_history``)."""
        return self._client.store.delete(records.validate_session_id(session_id), keep_history=keep_history)


def _check_limits(limits: object) -> None:
    if limits is not None and not isinstance(limits, Limits):
        raise errors.ConfigurationError("limits must be a Limits (from producer import Limits)")


def _check_idempotency_key(key: object) -> None:
    if not isinstance(key, str) or not 1 <= len(key) <= 200 or not key.isprintable():
        raise errors.ConfigurationError("idempotency_key must be 1-200 printable characters")
