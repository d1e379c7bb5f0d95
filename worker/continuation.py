"""Continuation: whether a step task takes its run's next step itself (``LOUSHO_CONTINUE_STEPS``).

``worker.steps.run_step`` asks ``next_step`` after each step; the task then claims the run again under the lease
and token it holds and takes the step as if it had come through the broker. A task shares its slice
(``LOUSHO_CONTINUE_MS``) with the step messages waiting in its queue, so runs queued behind chained tasks are
served within about one slice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from store import telemetry
from store.records import Lease
from worker.context import Next, Outcome, StepDeps, StepResult

#: How often a chain reads how many step messages wait in its queue (a read is one Redis round trip).
BACKLOG_EVERY_MS = 5.0


@dataclass
class Share:
    """A chained task's time: when it began, and the messages seen waiting in its queue at the last read."""

    began: float
    waiting: int = 0
    read_at: float = float("-inf")

    def waiting_now(self, deps: StepDeps) -> int:
        """The messages waiting, read again once ``BACKLOG_EVERY_MS`` passed since the last read."""
        now = time.monotonic()
        if deps.backlog is not None and (now - self.read_at) * 1000 >= BACKLOG_EVERY_MS:
            self.waiting, self.read_at = deps.backlog(), now
        return self.waiting


def next_step(
    deps: StepDeps,
    lease: Lease,
    result: StepResult,
    report: telemetry.StepReport | None,
    taken: int,
    share: Share,
) -> Next | None:
    """The next step this task takes itself after the step ``report`` tells of, or None to send it as a message.

    Only a plain advance with no countdown, on the same agent (a handoff's next step belongs on the other agent's
    queue), that started no child run, within the step count and the task's share of the slice, while the lease
    is held and no abort or steer past the saved input has been heard. The slice is shared with the step messages
    waiting in the task's queue (``deps.backlog``, read every ``BACKLOG_EVERY_MS``): with ``w`` of them a task
    stops after ``slice / (1 + w)``, so the runs waiting behind chained tasks are all served within about one
    slice.
    """
    follow = result.follow_up
    if taken >= deps.continue_steps or report is None or report.checkpoint is None:  # first: strict mode stops here
        return None
    if follow is None or result.outcome is not Outcome.ADVANCED or follow.countdown or result.also or result.watch:
        return None
    if follow.agent != report.agent or lease.lost.is_set() or lease.abort.is_set():
        return None
    if lease.steer > report.checkpoint.inbox_cursor:
        return None
    spent_ms = (time.monotonic() - share.began) * 1000
    return follow if spent_ms < deps.continue_ms / (1 + share.waiting_now(deps)) else None
