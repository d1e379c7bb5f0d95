"""What a step runs with: its dependencies, its outcome, and the fenced save every write goes through.

Framework-free (no Celery); shared by the step executor and the tool batch.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from store import errors, interfaces, telemetry
from store.model_limit import ModelLimit
from store.records import Approval, Checkpoint, EventDraft, Serving, StepWrite
from worker import budgets
from worker import live as live_events
from worker.agents import Agent
from worker.live import Live
from worker.slots import SlotKeeper

log = logging.getLogger("lousho.step")


class Enqueue(Protocol):
    """Sends ``advance`` for a run: to the queue of ``agent`` when given, else the shared queue."""

    def __call__(
        self,
        session_id: str,
        seq: int | None,
        countdown: float = 0.0,
        agent: str | None = None,
        /,
        *,
        name: str | None = None,
    ) -> None:
        """Send ``advance`` for the run (``seq`` None: whatever step is next), named ``name`` in Flower and logs."""


class Outcome(enum.StrEnum):
    """What a step did (logged, counted by the benchmark and tests)."""

    BUSY = "busy"  #: another holder has the lease; dropped, the holder goes on
    UNKNOWN = "unknown"  #: no such run
    STALE = "stale"  #: the message's seq is behind the run; a duplicate, dropped
    IDLE = "idle"  #: nothing to do (paused, finished, parked)
    ADVANCED = "advanced"  #: progress saved, next step enqueued
    AWAITING_APPROVAL = "awaiting-approval"  #: the run now waits on a person's decisions
    PAUSED = "awaiting-approval"  #: the name ``AWAITING_APPROVAL`` had before the runs' states were one vocabulary
    FINISHED = "finished"  #: the run finished
    FENCED = "fenced"  #: our save was refused: another holder took over
    FAILED = "failed"  #: the step failed; error recorded, retry scheduled
    HANDED_BACK = "handed-back"  #: this worker cannot run the step (deploy under way); another will
    PARKED = "parked"  #: the run stopped with a non-retryable error
    ABORTED = "aborted"  #: the run stopped on an abort request; every call has its result
    DELEGATED = "delegated"  #: the run waits on child runs (sub-agents); the last to settle wakes it
    WAITING = "waiting"  #: the run waits on its model limit (a slot, the minute's rate, a cool-down); no failure


@dataclass
class StepDeps:
    """What a step needs, built once per worker process."""

    store: interfaces.WorkerStore
    leases: interfaces.Leases
    heartbeat: interfaces.Heartbeat
    agents: dict[str, Agent]
    enqueue: Enqueue
    max_attempts: int = 5
    #: Longest backoff of our own before a failed step is retried (a provider's Retry-After may ask for more).
    retry_backoff_max_s: float = 30.0
    #: How long a streak of transient failures is retried before the run is parked.
    retry_for_s: float = 6 * 3600.0
    #: Live registrations of agents by workers; None when no fleet is known (a test in one process).
    registry: interfaces.AgentRegistry | None = None
    #: This worker's id in the registry (its own registrations are not "another worker").
    worker_id: str = ""
    #: A registration is live when refreshed within this many seconds.
    registry_window_s: float = 60.0
    fingerprints: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The runs' Redis signals (live events, doorbells); None in a test without Redis.
    signals: interfaces.Signals | None = None
    #: Seconds after its input a run of an agent no worker ever registered is parked (``LOUSHO_AGENT_GRACE_S``).
    agent_grace_s: float = 600.0
    #: The fleet's model limits (slots, buckets, cool-downs); None: agents' ``model_limit`` is not enforced (a test
    #: without Redis).
    slots: interfaces.ModelSlots | None = None
    #: Renews the slots this process's model calls hold (made with ``slots``).
    slot_keeper: SlotKeeper | None = None
    #: ``LOUSHO_MODEL_LIMITS`` by key: these numbers win over the ones agents give the key.
    model_limits: dict[str, ModelLimit] = field(default_factory=dict)
    #: ``LOUSHO_FAIRNESS_WEIGHTS`` by fairness key.
    fairness_weights: dict[str, int] = field(default_factory=dict)
    #: Steps of one run a task takes in a row under its lease (``LOUSHO_CONTINUE_STEPS``; 1: one per task).
    continue_steps: int = 1
    #: The time slice after which a task starts no next step of its run (``LOUSHO_CONTINUE_MS``).
    continue_ms: float = 100.0
    #: How many step messages wait in the queue the running task came from (a chain shares its slice with
    #: them); None: none are counted.
    backlog: Callable[[], int] | None = None

    def serving(self, agent: str) -> list[Serving]:
        """Other live workers that registered ``agent``."""
        if self.registry is None:
            return []
        return self.registry.serving(agent, self.registry_window_s, exclude=self.worker_id)

    def unregistered_for(self, agent: str, session_id: str) -> float | None:
        """Seconds since the run's first input when no worker ever registered ``agent`` (None: one did, or no fleet)."""
        if self.registry is None:
            return None
        return self.registry.unregistered_for(agent, session_id)

    def fingerprint(self, agent: Agent) -> dict[str, Any]:
        """The agent's fingerprint, computed once per process (once per step for a dynamic agent's choice)."""
        if self.agents.get(agent.name) is not agent:
            return agent.fingerprint()  # what a dynamic agent chose for a run
        if agent.name not in self.fingerprints:
            self.fingerprints[agent.name] = agent.fingerprint()
        return self.fingerprints[agent.name]


@dataclass(frozen=True)
class Next:
    """The follow-up ``advance`` message a step asks for; ``run_step`` sends it once the lease is released."""

    #: The run's seq when the message is sent; once the run has moved past it, the message is a stale duplicate.
    seq: int
    #: Seconds the broker holds the message back.
    countdown: float = 0.0
    #: The agent whose queue the message goes to (None: the shared queue).
    agent: str | None = None


@dataclass(frozen=True)
class StepResult:
    """What one step did and the follow-up message it asks for (None: no message)."""

    outcome: Outcome
    follow_up: Next | None = None
    #: More runs to send a step once the lease is released: ``(run id, agent)`` (children a lead started).
    also: tuple[tuple[str, str | None], ...] = ()
    #: The children the run still waits on, each with the state the step found it in (``subagents.state_of``).
    #: A child that settles while the step holds the lease finds it busy and its wake-up is dropped, so once the
    #: lease is released the step looks again and wakes the run itself when one of them moved on.
    watch: tuple[tuple[str, str], ...] = ()


def save(
    deps: StepDeps,
    checkpoint: Checkpoint,
    *,
    drained_inbox: bool = False,
    approvals: Sequence[Approval] = (),
    events: Sequence[EventDraft] = (),
    status_before: str | None = None,
    settles_abort: bool = False,
    live: Live | None = None,
) -> Checkpoint:
    """Fenced save of ``checkpoint`` as the next seq, with the durable events it makes true.

    ``events`` are the caller's; ``run.start`` (input merged), ``approval.requested`` (one per approval) and
    ``run.done`` (the run's input ended: finished, paused or aborted, coming from ``status_before``) are
    added here.

    Raises:
        FencedOutError: another holder claimed the run since we loaded it.
    """
    new = checkpoint.model_copy(update={"seq": checkpoint.seq + 1})
    restarted = drained_inbox or _resumes_stopped_input()
    if restarted:
        # A run input starts (or a stopped one moves again): its trace, when traces are on, joins this step to
        # every later one of the input.
        new = new.model_copy(update={"trace": telemetry.new_trace()})
    ending = status_before is not None and live_events.ends(new, status_before, drained_inbox)
    if ending and live is not None:
        new = budgets.clock_stopped(new, live.db_now()).model_copy(update={"end_due": live.end_hooks or new.end_due})
    drafts = [live_events.run_start(new)] if drained_inbox else []
    if live is not None and live.pending:
        drafts.extend(live.pending)
    drafts.extend(events)
    drafts.extend(live_events.approval_requested(approval) for approval in approvals)
    if status_before is not None:
        drafts = live_events.settled(drafts, new, status_before, drained_inbox)
    saved = deps.store.record_step(
        StepWrite(
            checkpoint=new,
            drained_inbox=drained_inbox,
            approvals=tuple(approvals),
            events=tuple(drafts),
            settles_abort=settles_abort,
            paused_before=status_before == "awaiting-approval",
        )
    )
    if saved is None:
        log.info("save refused for %s (fence %s): another holder took over", new.session_id, new.fence)
        raise errors.FencedOutError(new.session_id, new.fence)
    _noted(new, restarted, ending, approvals)
    if live is not None and status_before == "awaiting-approval" and new.status == "awaiting-approval":
        live.paused_through = True
    if live is not None:
        live.pending.clear()
        live.saved(len(drafts), ended=any(draft.type == "run.done" for draft in drafts))
        if ending and new.end_due:
            live.end_owed = new
    return new


def _resumes_stopped_input() -> bool:
    """Whether this is the first save of a step that moves an input stopped by an abort or its budget again.

    The stopped input's trace ended at the stop (``worker.tracing`` made its root span then), so it goes on in a
    new trace.
    """
    report = telemetry.current()
    claimed = report.checkpoint if report is not None else None  # the claimed checkpoint until the first save
    return (
        claimed is not None
        and claimed.status == "in-progress"
        and not claimed.aborted
        and claimed.finish_reason in ("aborted", "budget-exceeded")
    )


def _noted(saved: Checkpoint, drained_inbox: bool, ending: bool, approvals: Sequence[Approval]) -> None:
    """Tell the step's report what a save made true (an input started or ended, approvals opened)."""
    report = telemetry.current()
    if report is None:
        return
    report.checkpoint = saved
    report.approvals += len(approvals)
    if drained_inbox:
        report.input_started = True
        report.trace = saved.trace
    if ending:
        report.ended_as = _ended_as(saved)
        report.finish_reason = saved.finish_reason


def _ended_as(saved: Checkpoint) -> str:
    """How a save that ended the run's input left it: finished, awaiting-approval, aborted or budget-exceeded."""
    if saved.finish_reason == "budget-exceeded":
        return "budget-exceeded"
    if saved.aborted:
        return "aborted"
    return saved.status
