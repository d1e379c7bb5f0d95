"""``run_local``: an agent's run on the real step machine, in this process, on the in-memory stores.

The steps are ``worker.steps.run_step`` as a worker runs them (planning, batches, approvals, hooks, budgets,
sub-agents, handoffs, events); what differs is around them: the checkpoints, leases and approvals live in
``store.memory``, the step messages in a list delivered in order (a countdown is not waited for), no Redis
signal, no model limit, no Celery. Nothing here opens a socket; a model that calls a provider still does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from store import errors, faults
from store.events import Event
from store.inputs import Input, normalize_input
from store.memory import MemoryApprovalStore, MemoryCheckpointStore, MemoryLeaseManager
from store.records import Approval, Checkpoint, Lease
from store.summaries import RunResult
from worker.agents import Agent, reachable
from worker.steps import StepDeps, run_step

__all__ = ["Decide", "LocalRuntime", "run_local"]

#: ``decide(approval)``: True or False approves or rejects a gated call (a reconciliation runs again or is recorded
#: not done), a string answers a question (or a reconciliation), None leaves the approval pending.
Decide = Callable[[Approval], bool | str | None]

#: The lease TTL of the in-memory leases: long, nothing renews them.
LEASE_TTL_MS = 600_000


class _NoHeartbeat:
    """Renews nothing: a step here never outlives its lease."""

    def hold(self, lease: Lease) -> None:
        """Nothing to renew."""

    def drop(self, lease: Lease) -> None:
        """Nothing to stop."""

    def stop(self) -> None:
        """Nothing runs."""


@dataclass
class LocalRuntime:
    """The stores and the step queue of local runs; ``run_local`` makes one per call, a test may keep one.

    ``steps`` counts the steps delivered; ``crashes`` the simulated crashes, each recovered as the sweep would.
    """

    agents: dict[str, Agent]
    store: MemoryCheckpointStore = field(default_factory=lambda: MemoryCheckpointStore(history_limit=100_000))
    leases: MemoryLeaseManager = field(default_factory=lambda: MemoryLeaseManager(LEASE_TTL_MS))
    steps: int = 0
    crashes: list[faults.SimulatedCrash] = field(default_factory=list)
    #: ``LOUSHO_CONTINUE_STEPS`` and ``LOUSHO_CONTINUE_MS`` of the steps here (``steps`` counts the deliveries).
    continue_steps: int = 1
    continue_ms: float = 100.0
    _queue: deque[tuple[str, int | None]] = field(default_factory=deque)

    @classmethod
    def serving(cls, agents: Iterable[Agent], *, continue_steps: int = 1, continue_ms: float = 100.0) -> LocalRuntime:
        """A runtime serving ``agents`` with their handoffs and sub-agents (taking steps in a row as configured)."""
        return cls(agents=_with_reachable(agents), continue_steps=continue_steps, continue_ms=continue_ms)

    @property
    def approvals(self) -> MemoryApprovalStore:
        """The approvals of the runs here (``pending``, ``resolve``)."""
        return MemoryApprovalStore(self.store)

    def deps(self) -> StepDeps:
        """What a worker process gives ``run_step``, in memory."""
        return StepDeps(
            store=self.store,
            leases=self.leases,
            heartbeat=_NoHeartbeat(),
            agents=self.agents,
            enqueue=self._enqueue,
            continue_steps=self.continue_steps,
            continue_ms=self.continue_ms,
        )

    def _enqueue(
        self, session_id: str, seq: int | None, countdown: float = 0.0, agent: str | None = None, /, **_: object
    ) -> None:
        self._queue.append((session_id, seq))

    def send(self, session_id: str, agent: str, input: Input) -> int:
        """Put ``input`` in the run's inbox and queue its step, as ``AgentHandle.send`` does; the input's number."""
        number = self.store.append_input(session_id, agent, normalize_input(input))
        self._enqueue(session_id, None)
        return number

    def drain(self, max_steps: int) -> None:
        """Deliver queued steps in order until none is left.

        A step stopped by a simulated crash is recovered as the sweep recovers a dead process's run: its lease is
        dropped and its run sent a step again.

        Raises:
            RuntimeError: more than ``max_steps`` steps were delivered (a run that never settles).
        """
        deps = self.deps()
        while self._queue:
            if self.steps >= max_steps:
                raise RuntimeError(f"the runs did not settle within {max_steps} steps")
            session_id, seq = self._queue.popleft()
            self.steps += 1
            try:
                run_step(deps, session_id, seq)
            except faults.SimulatedCrash as crash:
                self.crashes.append(crash)
                self.leases.flush_all()
                self._enqueue(session_id, None)

    def decide_pending(self, session_ids: Iterable[str], decide: Decide) -> bool:
        """Ask ``decide`` about each pending approval of ``session_ids``; whether a decision let a run go on."""
        wanted = set(session_ids)
        moved = False
        for approval in self.approvals.pending(limit=10_000):
            if approval.session_id not in wanted:
                continue
            verdict = decide(approval)
            if verdict is None:
                continue
            if isinstance(verdict, bool):
                decision = self.approvals.resolve(approval.approval_id, approved=verdict)
            else:
                decision = self.approvals.resolve(approval.approval_id, answer=str(verdict))
            if decision.run_continues:
                self._enqueue(approval.session_id, None)
                moved = True
        return moved

    def settle(self, session_id: str, decide: Decide | None = None, max_steps: int = 1000) -> RunResult:
        """Deliver the queued steps, and the decisions ``decide`` gives, until run ``session_id`` ends or pauses.

        Raises:
            RuntimeError: more than ``max_steps`` steps were delivered in all.
        """
        while True:
            self.drain(max_steps)
            checkpoint = self.checkpoint(session_id)
            if checkpoint.status != "awaiting-approval" or decide is None:
                break
            if not self.decide_pending(self.family(session_id), decide):
                break
        return RunResult.of(checkpoint)

    def family(self, session_id: str) -> set[str]:
        """The run and every run it started, at any depth."""
        state = self.store.state
        with state.lock:
            parents = {run_id: row.parent_id for run_id, row in state.runs.items()}
        found = {session_id}
        grew = True
        while grew:
            more = {run_id for run_id, parent in parents.items() if parent in found} - found
            found |= more
            grew = bool(more)
        return found

    def events(self, session_id: str) -> Iterator[Event]:
        """The run's durable events, in order."""
        after = -1
        while page := self.store.read_events(session_id, after, 500):
            yield from page
            after = page[-1].seq if page[-1].seq is not None else after

    def checkpoint(self, session_id: str) -> Checkpoint:
        """The stored checkpoint of run ``session_id``.

        Raises:
            CheckpointNotFoundError: no such run.
        """
        checkpoint = self.store.load(session_id)
        if checkpoint is None:
            raise errors.CheckpointNotFoundError(f"run {session_id!r} is not stored")
        return checkpoint


def run_local(
    agent: Agent,
    input: Input,
    *,
    session_id: str = "local-1",
    decide: Decide | None = None,
    crash_at: str | Iterable[str] | None = None,
    runtime: LocalRuntime | None = None,
    max_steps: int = 1000,
) -> RunResult:
    """Run ``agent`` on ``input`` to its end (or its pause) in this process, and return how it settled.

    ``decide(approval)`` answers the approvals and questions of the run and its sub-agents as they come (see
    ``Decide``); without it, or when it leaves one pending, the result is the paused run's (``awaiting-approval``).
    ``crash_at`` names crash points (``store.faults.POINTS``): the first time a step reaches each, it stops there as
    if its process died, and the run recovers as on a worker (a tool's behaviour on recovery shows in the result
    and in ``runtime``). Pass ``runtime`` (``LocalRuntime.serving([...])``) to send a run more input later or to
    read its events, or to decide a paused run later (``runtime.settle(session_id, decide)``); a new one serves
    ``agent`` otherwise.

    Raises:
        ConfigurationError: an unknown crash point, or ``agent`` is not one ``runtime`` serves.
        RuntimeError: the run did not settle within ``max_steps`` steps.
    """
    points = frozenset([crash_at] if isinstance(crash_at, str) else crash_at or ())
    unknown = sorted(points - faults.POINTS)
    if unknown:
        raise errors.ConfigurationError(f"unknown crash point(s) {unknown}; known: {sorted(faults.POINTS)}")
    runtime = runtime or LocalRuntime.serving([agent])
    if runtime.agents.get(agent.name) is not agent:
        raise errors.ConfigurationError(f"agent {agent.name!r} is not one this runtime serves")
    runtime.send(session_id, agent.name, input)
    with faults.simulating(points):
        return runtime.settle(session_id, decide, max_steps)


def _with_reachable(agents: Iterable[Agent]) -> dict[str, Agent]:
    """``agents`` by name with the agents they hand off to or start as sub-agents (``agents.reachable``).

    Raises:
        ConfigurationError: two different agents have one name.
    """
    found: dict[str, Agent] = {}
    for agent in reachable(agents):
        if found.setdefault(agent.name, agent) is not agent:
            raise errors.ConfigurationError(f"two different agents are named {agent.name!r}")
    return found
