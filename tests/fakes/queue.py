"""The enqueue side of a step collected in a list, and a loop that delivers it like a worker."""

from __future__ import annotations

from dataclasses import dataclass

from worker.steps import Outcome, StepDeps, run_step


@dataclass(frozen=True)
class StepMessage:
    """One ``advance`` message: ids only, as on the broker."""

    session_id: str
    seq: int | None
    countdown: float = 0.0
    agent: str | None = None
    #: What Flower and the worker's log call the step (``store.telemetry.step_name``).
    name: str | None = None


class StepQueue:
    """Callable as ``StepDeps.enqueue``; keeps messages in send order."""

    def __init__(self) -> None:
        self.messages: list[StepMessage] = []
        self.sent: list[StepMessage] = []

    def __call__(
        self,
        session_id: str,
        seq: int | None,
        countdown: float = 0.0,
        agent: str | None = None,
        *,
        name: str | None = None,
    ) -> None:
        message = StepMessage(session_id, seq, countdown, agent, name)
        self.messages.append(message)
        self.sent.append(message)

    def __len__(self) -> int:
        return len(self.messages)

    def pop(self, index: int = 0) -> StepMessage:
        """Take one message off the queue (FIFO by default)."""
        return self.messages.pop(index)

    def drain(self, deps: StepDeps, limit: int = 1000) -> list[Outcome]:
        """Deliver messages in order until none is left; fails if the runs never settle."""
        outcomes: list[Outcome] = []
        for _ in range(limit):
            if not self.messages:
                return outcomes
            message = self.pop()
            outcomes.append(run_step(deps, message.session_id, message.seq))
        raise AssertionError(f"queue not drained after {limit} steps: {self.messages[:5]}")
