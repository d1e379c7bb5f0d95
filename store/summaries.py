"""What is read of a run: its summary, what it waits on, a page of them, and how it settled (``RunResult``).

``RunSummary`` and ``WaitingOn`` are what an operator reads; ``RunResult`` what a caller's wait returns.

Records only: ``store.explain`` decides what a run waits on and what moves it next, ``store.observed`` reads the
facts it decides from, and ``producer.client`` hands these out (``Client.runs``, ``Client.describe``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from store.records import Checkpoint, LastError, ListedRun, ListedState, Message, Status, ToolCall, Usage

#: Where a run's next step message is: in a queue of the broker, or taken by a worker that has not acked it yet.
MessagePlace = Literal["queued", "reserved"]


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WaitingOn(_Record):
    """What an unfinished run waits on, as far as can be seen now; every part empty or None when it is nothing.

    Read from Postgres and Redis at one moment (``store.observed``), never stored.
    """

    #: The owner id (``host:pid:nonce``) of the live lease on the run: a worker holds it now.
    lease_holder: str | None = None
    #: Milliseconds since that holder took or last renewed the lease (it renews every ``LOUSHO_LEASE_RENEW_MS``).
    lease_age_ms: int | None = None
    #: Where a step message for the run is (None: none was seen in the broker).
    step_message: MessagePlace | None = None
    #: When the next attempt after a transient failure is due (in the future: the run waits for it).
    retry_at: datetime | None = None
    #: Undecided approvals the run pauses on: its own, and for a lead its children's.
    approval_ids: list[str] = Field(default_factory=list)
    #: Children that have not settled (a lead waits for them).
    children: list[str] = Field(default_factory=list)
    #: The run's agent when no live worker serves it now (a step message for it waits for one).
    unserved_agent: str | None = None
    #: A person must act: the run is parked, aborted, stopped at a budget, or waits on decisions.
    person: bool = False
    #: The ``ModelLimit`` key the run waits on before its model call, and why (``slot``: no free slot; ``requests``,
    #: ``tokens``: the minute's budget is spent; ``cool-down``: the provider answered 429/529 with Retry-After).
    model_limit: str | None = None
    model_limit_reason: str | None = None


class RunSummary(_Record):
    """One run as an operator sees it: where it stands, what it spent, and (``describe``) why it is not finished.

    ``waiting_on`` and ``next_action`` are filled by ``Client.describe``; a listing (``Client.runs``) leaves them
    None, as it reads neither Redis nor the broker. ``cost`` (``describe`` only) is the sum of the costs its workers
    recorded with its model turns (``step.done`` events, at the agent's ``Agent(prices=...)``), None when they
    recorded none: the producer never imports an agent to price usage.
    """

    session_id: str
    agent: str
    state: ListedState
    status: Status
    finish_reason: str | None = None
    step: int = 0
    usage: Usage = Field(default_factory=Usage)
    cost: float | None = None
    last_error: LastError | None = None
    #: Crash restarts of the current step (the poison-pill count).
    attempts: int = 0
    #: Transient failures in a row (the backoff's exponent); reset by the next save.
    failures: int = 0
    next_attempt_at: datetime | None = None
    #: The lead of a sub-agent's run (None for a run of its own).
    parent_id: str | None = None
    created_at: datetime
    updated_at: datetime
    waiting_on: WaitingOn | None = None
    #: In words: what will move the run and when, or that a person must act, and how.
    next_action: str | None = None
    #: The run's business state as last saved (``describe`` only: a listing leaves it None).
    business_state: Any = None

    @classmethod
    def listed(cls, run: ListedRun) -> RunSummary:
        """The summary of a run as a detailed listing gave it (``list_runs(details=True)``)."""
        return cls(
            session_id=run.session_id,
            agent=run.agent,
            state=run.state,
            status=run.status,
            finish_reason=finish_reason(run.status, run.finish_reason),
            step=run.step or 0,
            usage=run.usage or Usage(),
            last_error=run.last_error,
            attempts=run.attempts,
            failures=run.failures,
            next_attempt_at=run.next_attempt_at,
            parent_id=run.parent_id,
            created_at=run.created_at,
            updated_at=run.updated_at,
        )


def finish_reason(status: Status, stored: str | None) -> str | None:
    """The finish reason a summary shows: the stored one; a run paused on approvals has ``awaiting-approval``.

    The same reading as ``RunResult.of`` (a pausing save leaves the stored finish reason unset).
    """
    return "awaiting-approval" if status == "awaiting-approval" else stored


class RunPage(_Record):
    """A page of ``Client.runs``: newest first; ``next_cursor`` continues toward older runs (None: no more)."""

    items: list[RunSummary]
    next_cursor: str | None = None
    #: Back toward newer runs (None on a first page).
    prev_cursor: str | None = None


__all__ = ["MessagePlace", "RunPage", "RunResult", "RunSummary", "WaitingOn", "finish_reason"]


class RunResult(BaseModel):
    """How a run settled, by ``finish_reason``.

    - ``stop``: the model answered without calling a tool.
    - ``length``: the answer was cut at the provider's token limit (``max_tokens``); the text is partial.
    - ``content-filter``: the provider withheld or refused the answer.
    - ``max-steps``: the agent's ``max_steps`` ran out.
    - ``awaiting-approval``: paused on approvals or questions (``approval_ids``).
    - ``aborted``: stopped by ``abort()``; every call has its result; a send or ``resume()`` continues it.
    - ``budget-exceeded``: a limit of the agent's ``Limits`` was reached before a model call; the run stays in
      progress and ``resume(..., limits=...)`` continues it under raised limits.
    """

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
            session_id=checkpoint.session_id,
            finish_reason=finish,
            text=checkpoint.final_text,
            messages=list(checkpoint.messages),
            steps=checkpoint.step,
            usage=checkpoint.usage,
            tool_calls=checkpoint.run_tool_calls,
            approval_id=checkpoint.approval_ids[0] if checkpoint.approval_ids else None,
            approval_ids=list(checkpoint.approval_ids),
        )
