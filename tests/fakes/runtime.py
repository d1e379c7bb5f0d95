"""A whole step runtime in memory: fake clock, store, leases, heartbeat and queue behind ``StepDeps``.

Sends go through the input rules (``store.inputs``) and the store's inbox, steps through ``run_step``, so a
unit test exercises the same path as a worker, minus Celery and the network.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from store import interfaces
from store.inputs import Input, normalize_input
from store.memory import MemoryCheckpointStore, MemoryLeaseManager
from store.records import Checkpoint
from tests.fakes.clock import FakeClock
from tests.fakes.heartbeat import NullHeartbeat
from tests.fakes.queue import StepQueue
from worker.agents import Agent
from worker.steps import Outcome, StepDeps, run_step

TTL_MS = 2000


@dataclass
class MemoryRuntime:
    """Everything one worker process needs, in memory, plus the producer's ``send``."""

    clock: FakeClock
    store: MemoryCheckpointStore
    leases: interfaces.Leases
    heartbeat: NullHeartbeat
    queue: StepQueue
    deps: StepDeps

    @classmethod
    def build(
        cls,
        agents: Iterable[Agent],
        *,
        history_limit: int = 50,
        max_attempts: int = 5,
        leases: interfaces.Leases | None = None,
        clock: FakeClock | None = None,
        store: MemoryCheckpointStore | None = None,
    ) -> MemoryRuntime:
        """A runtime serving ``agents``; leases default to in-memory ones on the same clock."""
        clock = clock or FakeClock()
        store = store or MemoryCheckpointStore(history_limit=history_limit, clock=clock)
        leases = leases or MemoryLeaseManager(TTL_MS, clock)
        heartbeat = NullHeartbeat()
        queue = StepQueue()
        deps = StepDeps(
            store=store,
            leases=leases,
            heartbeat=heartbeat,
            agents={agent.name: agent for agent in agents},
            enqueue=queue,
            max_attempts=max_attempts,
        )
        return cls(clock, store, leases, heartbeat, queue, deps)

    def send(self, session_id: str, agent: str, input: Input) -> int:
        """What ``AgentHandle.send`` does: input into the run's inbox, then an ``advance`` message."""
        number = self.store.append_input(session_id, agent, normalize_input(input))
        self.queue(session_id, None)
        return number

    def step(self, session_id: str, seq: int | None = None) -> Outcome:
        """Deliver one ``advance`` message directly."""
        return run_step(self.deps, session_id, seq)

    def drain(self, limit: int = 1000) -> list[Outcome]:
        """Deliver queued messages until there are none."""
        return self.queue.drain(self.deps, limit)

    def checkpoint(self, session_id: str) -> Checkpoint:
        """The stored checkpoint of a run that must exist."""
        checkpoint = self.store.load(session_id)
        assert checkpoint is not None, f"run {session_id!r} is not stored"
        return checkpoint

    def sweep(self, stale_after_s: float = TTL_MS / 1000) -> int:
        """What the recover task does: re-enqueue stale runs that hold no live lease."""
        candidates = self.store.stale_runs(stale_after_s)
        live = self.leases.held([sid for sid, _ in candidates])
        sent = []
        for session_id, seq in candidates:
            if session_id not in live:
                self.queue(session_id, seq)
                sent.append(session_id)
        self.store.mark_swept(sent)
        return len(sent)
