"""The ports callers type against: checkpoints, approvals, leases, heartbeat, agent registry, deliveries, schedules.

Only ``typing.Protocol`` classes over ``store.records``; implementations (Postgres, Redis, memory) need no
inheritance and are held to them by the contract suites in ``tests/``. Nothing here does I/O.

Stays whole: the ports are one contract, read together by every store that implements them.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from store import records
from store.events import Event

if TYPE_CHECKING:
    from store.model_limit import LimitConflict, ModelLimit, SlotAnswer, SlotUsage
    from store.schedule_records import Fire, Origin, Planner, Schedule, ScheduleSpec, Swept

__all__ = [
    "AgentRegistry",
    "ApprovalStore",
    "CheckpointStore",
    "DeliveryStore",
    "Heartbeat",
    "Leases",
    "ModelSlots",
    "ProducerStore",
    "RecoveryStore",
    "ScheduleStore",
    "ServingRegistry",
    "Signals",
    "StepStore",
    "WorkerStore",
]


# -- the checkpoint store, by who uses it ------------------------------------------------------------
# A step needs ``StepStore`` (it hands over a ``StepWrite``: what it added, not a document to overwrite), the
# recovery sweep ``RecoveryStore``, a worker process both (``WorkerStore``), the client ``ProducerStore``.
# ``CheckpointStore`` is all of them: what every implementation offers and the contract suite checks.


class StepStore(Protocol):
    """What one step does to its run: claim the fence, read input, write what it did, record failures.

    Every write is fenced: it takes effect only while the run's stored fence is the caller's token.
    """

    def pinned(self) -> AbstractContextManager[None]:
        """Serve this thread's calls from one connection until the block ends (a step's; nesting is allowed)."""

    def claim(self, session_id: str, token: int, seq: int | None, *, again: bool = False) -> records.Claim:
        """Claim ``token`` as the run's fence and load the run; no checkpoint when unknown or out-fenced.

        ``again``: the holder of ``token`` claims the run once more, for the next step it chains.
        """

    def inbox(self, session_id: str, cursor: int) -> builtins.list[records.InboxEntry]:
        """Input sent after ``cursor``, in send order."""

    def record_step(self, write: records.StepWrite) -> datetime | None:
        """Write what a step did as the run's next seq; the save time, or None when fenced out.

        Raises:
            InputTooLargeError: the serialized checkpoint is over the size limit.
        """

    def note_usage(self, session_id: str, fence: int, usage: records.Usage) -> bool:
        """Keep a model call's usage before its turn is written; False when fenced out."""

    def note_wait(self, session_id: str, fence: int) -> bool:
        """Take back the attempt the step's claim counted: it waits on a model limit; False when fenced out."""

    def record_failure(
        self, session_id: str, fence: int, error: records.LastError, drafts: Sequence[records.EventDraft] = ()
    ) -> int | None:
        """Store why a step failed, with ``drafts`` as its events; the attempts count, None when fenced out."""

    def settle_end(self, session_id: str, fence: int, seq: int) -> bool:
        """Note (fenced) that the ``on_run_end`` hooks owed since save ``seq`` ran; False when none were owed."""

    def start_children(
        self, lead: str, lead_agent: str, children: Sequence[tuple[str, str, str]], *, fence: int
    ) -> builtins.list[str]:
        """Create the child runs ``(child_id, agent, prompt)`` of ``lead`` (run by ``lead_agent``) not there yet.

        Fenced like a save: the lead must be stored with ``fence``. Returns the ids refused because a run that is
        not the lead's child holds them.

        Raises:
            FencedOutError: the lead is gone or its fence moved on (nothing is written).
        """

    def load(self, session_id: str) -> records.Checkpoint | None:
        """The run's latest checkpoint (a child's, read by its lead's step), or None."""

    def request_abort(self, session_id: str) -> bool:
        """Ask for the run (and its children) to stop; False when it is finished or already stopped."""

    def retry_later(
        self,
        session_id: str,
        fence: int,
        error: records.LastError,
        delay_s: float,
        drafts: Sequence[records.EventDraft] = (),
    ) -> int | None:
        """Record a transient failure and when to try again; the run's seq, None when fenced out."""

    def refuse(
        self,
        session_id: str,
        fence: int,
        error: records.LastError,
        approval_ids: Sequence[str],
        drafts: Sequence[records.EventDraft] = (),
    ) -> bool:
        """Park the run on ``error`` and put the decisions of ``approval_ids`` back; False when fenced out."""

    def abort_requested(self, session_id: str) -> bool:
        """Whether an abort of the run waits for a step to settle it."""

    def decisions(self, approval_ids: Sequence[str]) -> dict[str, records.Approval]:
        """The approvals of a pause, by id (missing ids are left out)."""


class RecoveryStore(Protocol):
    """What the recovery sweep reads: runs that should be moving and are not."""

    def due_runs(
        self, stale_after_s: float, limit: int = 500, after: records.DueRun | None = None
    ) -> builtins.list[records.DueRun]:
        """Runs a step can move now, most overdue first; ``after`` continues from the previous page."""

    def stale_runs(self, stale_after_s: float, limit: int = 500) -> builtins.list[tuple[str, int]]:
        """``(session_id, seq)`` of the runs ``due_runs`` lists."""

    def mark_swept(self, session_ids: Sequence[str]) -> None:
        """Note that a step was just sent for these runs: ``due_runs`` leaves them out for a while.

        Marks each as recovering (with where it stood) until ``settle_recoveries`` reports how it came out.
        """

    def settle_recoveries(self, agents: Sequence[str], limit: int = 500) -> builtins.list[records.SweptRun]:
        """The runs of ``agents`` the sweep sent on that came out since (recovered or failed again), each once."""

    def waiting_leads(self, stale_after_s: float, limit: int = 500) -> builtins.list[records.DueRun]:
        """Leads waiting on children none of which can still move: their wake-up was lost."""

    def expire_approvals(self, limit: int = 500) -> int:
        """Reject up to ``limit`` pending approvals past their ``expires_at`` (a note says so); how many.

        A run left with no pending approval continues, as after a human's last decision (``due_runs`` lists it).
        """


class WorkerStore(StepStore, RecoveryStore, Protocol):
    """What a worker process uses: its steps, its recovery sweep, and the names of the agents it serves."""

    def register_agents(self, fingerprints: dict[str, dict[str, Any]]) -> None:
        """Record the agents a worker serves, so producers can refuse unknown names."""


class ProducerStore(Protocol):
    """What producers use: queue input, fork, resume, read, list and delete runs."""

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
        """Queue input for a run (creating it) and return its inbox number.

        ``metadata`` rides with the input for the application's code (a dynamic agent's ``resolve``, hooks);
        ``business_state`` (not None) replaces the run's when the input is merged, and ``fairness_key`` (not None)
        the run's fairness key (its waits for a model slot go round-robin by it).

        Raises:
            SessionAwaitingApprovalError: the run waits on an approval.
            ConfigurationError: the session belongs to another agent.
            CheckpointCorruptError: the stored run cannot be read.
        """

    def create_run(self, checkpoint: records.Checkpoint, queued: Sequence[records.Message] = ()) -> bool:
        """Store a new run as ``checkpoint`` (a fork) with ``queued`` input; False if the id is taken."""

    def reset_attempts(self, session_id: str, limits: dict[str, Any] | None = None) -> int | None:
        """Clear a parked, waiting or stopped run's stop so it runs now; its seq, None when it has nothing to do.

        A run waiting on children moves only when none of them can still move by itself. ``limits``
        (``Limits.stored()``) replace the agent's limits for the run from now on.
        """

    def request_abort(self, session_id: str) -> bool:
        """Ask for the run to stop; False when it is finished or already aborted.

        Raises:
            CheckpointNotFoundError: no such run.
        """

    def read_events(self, session_id: str, after: int, limit: int = 500) -> builtins.list[Event]:
        """Durable events of the run with a seq above ``after``, oldest first."""

    def input_start(self, session_id: str, number: int) -> int | None:
        """The seq of the ``run.start`` that merged input ``number``, None while it is not merged."""

    def latest_start(self, session_id: str) -> int | None:
        """The seq of the run's latest ``run.start`` event, None when it has none."""

    def load(self, session_id: str) -> records.Checkpoint | None:
        """The latest checkpoint of a run, or None.

        Raises:
            CheckpointCorruptError: the stored document does not parse as a checkpoint.
        """

    def progress(self, session_id: str) -> records.Progress | None:
        """A run's status, inbox cursor and last error, without its transcript; None if unknown."""

    def list(
        self,
        *,
        statuses: Iterable[str] | None = None,
        agent: str | None = None,
        limit: int = 1000,
        newest: bool = False,
    ) -> builtins.list[records.Checkpoint | records.PendingRun]:
        """Latest checkpoints by creation, the last created first with ``newest``; unreadable ones as ``PendingRun``."""

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
        """A page of runs, newest first by creation, filtered and paged by the store, without their transcripts.

        ``cursor`` is a ``next_cursor`` or ``prev_cursor`` of an earlier page; runs created since do not move
        the runs of the pages it leads to. ``details`` adds each listed run's finish reason, step and usage.

        Raises:
            ConfigurationError: a cursor no page gave, a limit out of range, an unknown state or a naive ``since``.
        """

    def count_runs(
        self, *, agents: Iterable[str] | None = None, since: datetime | None = None
    ) -> dict[records.ListedState, int]:
        """How many runs (of ``agents``, created at or after ``since``) stand in each state; states with none left out.

        Raises:
            ConfigurationError: a naive ``since``.
        """

    def history(self, session_id: str, limit: int | None = None) -> builtins.list[records.HistoryEntry]:
        """Saved states of a run, newest first; ``[]`` for an unknown run."""

    def pending(self, agent: str | None = None, limit: int = 1000) -> builtins.list[records.PendingRun]:
        """Runs that are not finished (every state but ``finished``), oldest first."""

    def delete(self, session_id: str, *, keep_history: bool = False) -> bool:
        """Drop a run's checkpoint and inbox (and its history unless ``keep_history``)."""

    def prune(self, older_than: datetime) -> int:
        """Drop finished runs last saved before ``older_than`` and history entries older than it.

        Raises:
            ConfigurationError: ``older_than`` is a naive datetime.
        """

    def known_agents(self) -> builtins.list[str]:
        """Names of agents some worker registered."""


class CheckpointStore(WorkerStore, ProducerStore, Protocol):
    """The whole checkpoint store: what ``PostgresCheckpointStore`` and ``MemoryCheckpointStore`` offer."""


# -- approvals, leases, heartbeat ------------------------------------------------------------------


class ApprovalStore(Protocol):
    """Reads and decisions on the approvals that pausing writes open."""

    def by_ids(self, approval_ids: Sequence[str]) -> dict[str, records.Approval]:
        """Approvals by id (missing ids are left out)."""

    def pending(self, agent: str | None = None, limit: int = 1000) -> builtins.list[records.Approval]:
        """Undecided approvals, oldest first."""

    def resolve(
        self, approval_id: str, approved: bool | None = None, note: str | None = None, answer: str | None = None
    ) -> records.Decision:
        """Decide an approval once: approve or reject a tool call, answer (``answer``) or decline a question.

        Raises:
            ApprovalNotFoundError: unknown, or already decided.
            ApprovalExpiredError: past its ``expires_at``: recorded as rejected (the run goes on), nothing else.
            ApprovalOrphanedError: its run no longer waits on it; it is withdrawn and nothing runs.
        """


class Signals(Protocol):
    """What a step sends on a run's signals (``store.signals``); best effort, never raising."""

    def publish(self, session_id: str, payload: str) -> None:
        """Publish ``payload`` (JSON text) on the run's channel."""

    def clear_abort(self, session_id: str) -> None:
        """Silence the run's abort doorbell."""

    def clear_steer(self, session_id: str) -> None:
        """Forget the run's steer mark."""


class Leases(Protocol):
    """Run leases with fencing tokens: what the step, the heartbeat, the producer and the sweep use."""

    ttl_ms: int

    def acquire(self, session_id: str, floor: int = 0) -> records.Lease | None:
        """Take the run's lease with a fencing token above ``floor``; None when it is held.

        Raises:
            SessionIdInvalidError: the id is not a valid run id (nothing is touched).
        """

    def raise_token(self, lease: records.Lease, floor: int) -> bool:
        """Give ``lease`` a token above ``floor`` if it is still held; False when it is not."""

    def renew(self, lease: records.Lease) -> bool:
        """Push the lease's expiry out by one TTL; False (and ``lost`` set) when it is not ours anymore."""

    def renew_many(self, leases: builtins.list[records.Lease]) -> None:
        """Renew several leases, setting ``lost`` on those that are not ours anymore."""

    def release(self, lease: records.Lease) -> bool:
        """Drop the lease if we still own it."""

    def holder(self, session_id: str) -> str | None:
        """The owner id of the live lease on a run, if any.

        Raises:
            SessionIdInvalidError: the id is not a valid run id.
        """

    def held(self, session_ids: builtins.list[str]) -> set[str]:
        """Which of these runs have a live lease."""

    def release_gone(self, session_ids: builtins.list[str]) -> builtins.list[str]:
        """Release the leases on these runs whose holder is provably gone (``store.owners``); the runs freed."""


class Heartbeat(Protocol):
    """Keeps the leases a process holds renewed while its steps run."""

    def hold(self, lease: records.Lease) -> None:
        """Keep ``lease`` renewed until ``drop``."""

    def drop(self, lease: records.Lease) -> None:
        """Stop renewing ``lease``."""

    def stop(self) -> None:
        """Stop renewing anything (shutdown)."""


class ModelSlots(Protocol):
    """``ModelLimit`` slots, buckets and cool-downs shared by the fleet: what a step, the sweep and metrics use."""

    ttl_ms: int

    def acquire(
        self, limit: ModelLimit, session_id: str, agent: str, fairness_key: str | None = None, weight: int = 1
    ) -> SlotAnswer:
        """Take a slot (and a request of the minute) for one model call of the run, or say why it waits.

        A run that finds no free slot waits in line under ``fairness_key`` (weighted by ``weight``) and is named
        in a later answer's ``woken`` when a slot is kept for it; the freed slots go round-robin by fairness key.

        Raises:
            SessionIdInvalidError: the run id is not valid (nothing is touched).
            ConfigurationError: the fairness key is not valid.
        """

    def renew(self, key: str, session_ids: builtins.list[str]) -> int:
        """Push out the expiry of the slots of ``key`` these runs' calls in flight hold; how many were still held.

        A lost slot (Redis lost its keys, a holder stalled past its expiry) is taken again: the call counts.
        """

    def release(self, limit: ModelLimit, session_id: str, tokens: int = 0) -> tuple[tuple[str, str], ...]:
        """Give back the run's slot, counting ``tokens`` (reported usage); the runs ``(id, agent)`` woken."""

    def cool_down(self, key: str, seconds: float) -> None:
        """Hold every caller of ``key`` for ``seconds`` (a 429's ``Retry-After``); a longer cool-down stays."""

    def waiting(self, session_ids: builtins.list[str]) -> dict[str, tuple[str, str]]:
        """The runs among these that wait on a model limit: run id -> (limit key, reason)."""

    def wake(self) -> tuple[tuple[str, str], ...]:
        """For every limit key: drop dead holders' slots and give the free ones to waiters; the runs woken."""

    def usage(self) -> builtins.list[SlotUsage]:
        """Slots in use, runs waiting and cool-down left (seconds), per limit key."""


# -- agent registry, deliveries, schedules ---------------------------------------------------------


class ServingRegistry(Protocol):
    """Which live workers serve an agent: what a step asks before handing a run back."""

    def serving(self, agent: str, within_s: float, exclude: str = "") -> builtins.list[records.Serving]:
        """Live registrations of ``agent`` (seen in the last ``within_s`` seconds), ``exclude`` left out."""


class AgentRegistry(ServingRegistry, Protocol):
    """Registrations of the agents each live worker serves."""

    def register(
        self,
        worker_id: str,
        fingerprints: Mapping[str, dict[str, Any]],
        formats: Iterable[int],
        limits: Mapping[str, ModelLimit] | None = None,
    ) -> None:
        """Record that ``worker_id`` serves these agents, reads these checkpoint formats and holds these limits, now."""

    def limit_conflicts(self, within_s: float) -> builtins.list[LimitConflict]:
        """The model limit keys live workers (seen in the last ``within_s`` seconds) give different numbers."""

    def refresh(self, worker_id: str) -> None:
        """Say ``worker_id`` is still alive."""

    def forget(self, worker_id: str) -> None:
        """Drop a stopping worker's registrations."""

    def live_agents(self, within_s: float) -> set[str]:
        """Agents at least one live worker (seen in the last ``within_s`` seconds) serves."""

    def unregistered_for(self, agent: str, session_id: str) -> float | None:
        """Seconds since run ``session_id``'s first input, when no worker ever registered ``agent``; else None."""


class DeliveryStore(Protocol):
    """Webhook deliveries keyed by (agent, delivery id); a delivery starts its run exactly once."""

    def record(
        self,
        agent: str,
        delivery_id: str,
        source: records.DeliverySource,
        body_sha256: str,
        messages: Sequence[records.Message],
        fairness_key: str | None = None,
    ) -> records.Intake:
        """Record a verified delivery and start its run (with ``fairness_key``), in one transaction.

        Raises:
            ConfigurationError: the delivery id is malformed, or its run id belongs to another agent.
            SessionAwaitingApprovalError: the run id is taken by a run paused on an approval.
            StorageError: the store failed; nothing was written.
        """

    def get(self, agent: str, delivery_id: str) -> records.Delivery | None:
        """The recorded delivery, or None."""


class ScheduleStore(Protocol):
    """Schedule definitions, their state, and the claim of their ticks."""

    def create(self, spec: ScheduleSpec, origin: Origin = "api") -> Schedule:
        """Store a new schedule.

        Raises:
            ConfigurationError: the name is taken.
        """

    def sync(self, spec: ScheduleSpec, origin: Origin = "code") -> Schedule:
        """Create ``spec`` or redefine the schedule of that name (declared in code)."""

    def get(self, name: str) -> Schedule:
        """The schedule named ``name``.

        Raises:
            ScheduleNotFoundError: no such schedule.
        """

    def list(self) -> builtins.list[Schedule]:
        """Every schedule, by name."""

    def pause(self, name: str) -> Schedule:
        """Stop firing ``name`` until it is resumed.

        Raises:
            ScheduleNotFoundError: no such schedule.
        """

    def resume(self, name: str) -> Schedule:
        """Fire ``name`` again from its next tick after now.

        Raises:
            ScheduleNotFoundError: no such schedule.
        """

    def delete(self, name: str) -> bool:
        """Drop the schedule and its tick claims (the runs it started stay); False when unknown."""

    def fires(self, name: str, limit: int = 100) -> builtins.list[Fire]:
        """The schedule's claimed ticks, newest first."""

    def fire_next_due(self, plan: Planner) -> Swept | None:
        """Apply ``plan`` to the most overdue schedule no other sweep holds; None when none is due.

        Raises:
            StorageError: the store failed; nothing of this schedule was written.
        """
