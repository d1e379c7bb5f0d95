"""What a step tells the world: durable event drafts for its saves, and live signals while someone watches.

Durable events (``store.events``) are drafted here and written by the save that makes them true. Live
signals (``step.start``, ``text.delta``, ``tool.start``) are published on the run's channel only while a
consumer watches (``Lease.watched``, read with the lease), so an unwatched step pays nothing for them.
``Live`` is also the ``Listener`` a streaming model reports to, and tells whether the model call has
emitted anything yet (a steer cuts short only a call that has not).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

from store import payloads
from store.interfaces import Signals
from store.records import Approval, Checkpoint, EventDraft, LastError, Lease, Message, ToolCall, Usage

__all__ = ["Live", "approval_requested", "run_done", "run_start", "step_done", "tool_reconcile", "tool_result"]


def run_start(checkpoint: Checkpoint) -> EventDraft:
    """The run took new input (merged up to ``inbox_cursor``)."""
    return EventDraft(
        type="run.start", data={"agent": checkpoint.agent, "input_number": checkpoint.inbox_cursor, "resumed": False}
    )


def step_done(
    step: int, turn: Message, usage: Usage, duration_ms: float | None = None, cost: float | None = None
) -> EventDraft:
    """Model turn ``turn`` (step ``step``) was saved; its text and calls come from its row.

    ``duration_ms`` is how long the turn took, from the model call to the save: with the event's time (the
    save's), it places the turn on a run's timeline. ``cost`` is what the turn's usage cost at the run's prices
    (``Agent(prices=...)``), recorded here because readers of the run never import its agent.
    """
    data: dict[str, Any] = {"step": step, "usage": usage.model_dump()}
    if duration_ms is not None:
        data["duration_ms"] = round(duration_ms, 3)
    if cost is not None:
        data["cost"] = cost
    return EventDraft(type="step.done", data=data, message=turn)


def tool_result(result: Message, duration_ms: float | None) -> EventDraft:
    """A call's result was saved: ``tool.done``, or ``tool.error`` for an error result."""
    kind = "tool.error" if result.is_error else "tool.done"
    data: dict[str, Any] = {"duration_ms": None if duration_ms is None else round(duration_ms, 3)}
    return EventDraft(type=kind, data=data, message=result)


def approval_requested(approval: Approval) -> EventDraft:
    """The run paused on ``approval``."""
    return EventDraft(
        type="approval.requested",
        data={
            "approval_id": approval.approval_id,
            "tool_call_id": approval.tool_call_id,
            "tool_name": approval.tool_name,
            "args": approval.args,
            "kind": approval.kind,
            **({"question": approval.question, "options": approval.options} if approval.kind == "question" else {}),
            **({"question": approval.question} if approval.kind == "reconcile" else {}),
        },
    )


def tool_reconcile(call: ToolCall, outcome: str, by: str, attempt: int, code: str | None = None) -> EventDraft:
    """What became of a ``once`` call its worker died in.

    ``outcome``: ``happened`` (a result was recorded), ``not-happened`` (it runs again), ``not-done`` (a person
    recorded it as not done), ``failed`` (``reconcile`` raised; retried) or ``asked`` (a person decides);
    ``by``: ``reconcile`` (the tool's function, or its absence) or ``person``.
    """
    data: dict[str, Any] = {
        "tool_call_id": call.id,
        "tool_name": call.name,
        "outcome": outcome,
        "by": by,
        "attempt": attempt,
    }
    if code is not None:
        data["code"] = code
    return EventDraft(type="tool.reconcile", data=data)


def run_done(checkpoint: Checkpoint, finish_reason: str | None = None) -> EventDraft:
    """The run settled: finished, paused, aborted, or stopped on an error (``finish_reason="error"``)."""
    reason = (
        finish_reason
        or checkpoint.finish_reason
        or ("awaiting-approval" if checkpoint.status == "awaiting-approval" else None)
    )
    return EventDraft(
        type="run.done",
        data={
            "finish_reason": reason,
            "text": checkpoint.final_text,
            "usage": checkpoint.usage.model_dump(),
            "steps": checkpoint.step,
            "approval_ids": list(checkpoint.approval_ids),
        },
    )


def error(error: LastError) -> EventDraft:
    """A step failed with ``error``."""
    return EventDraft(type="error", data={"code": error.code, "message": error.message, "retryable": error.retryable})


def provider_retry(error: LastError, failures: int, delay_s: float) -> EventDraft:
    """A provider call failed transiently and will be tried again in ``delay_s``."""
    return EventDraft(
        type="provider.retry",
        data={"code": error.code, "message": error.message, "failures": failures, "delay_s": round(delay_s, 3)},
    )


def handoff(source: str, target: str) -> EventDraft:
    """The run moved from agent ``source`` to agent ``target`` (a ``transfer_to_`` call)."""
    return EventDraft(type="agent.handoff", data={"from": source, "to": target})


def drift(found: dict[str, Any]) -> EventDraft:
    """The agent changed since the run was saved (the policy let it continue)."""
    return EventDraft(type="agent.drift", data=found)


def ends(checkpoint: Checkpoint, status_before: str, drained: bool) -> bool:
    """Whether saving ``checkpoint`` ends the run's input: finished, paused, or stopped (an abort, a budget).

    Only a save that ends it does: one that changes the status, stops the run, or merged input.
    """
    ended = checkpoint.status != "in-progress" or checkpoint.aborted
    return ended and (drained or checkpoint.aborted or status_before != checkpoint.status)


def settled(drafts: list[EventDraft], checkpoint: Checkpoint, status_before: str, drained: bool) -> list[EventDraft]:
    """``drafts`` plus ``run.done`` when ``checkpoint`` ends the run's input (``ends``)."""
    if ends(checkpoint, status_before, drained):
        return [*drafts, run_done(checkpoint)]
    return drafts


class _CutShort:
    """``Live.cancelled``: a model call should stop on an abort, or on a steer before it emitted anything.

    Read from the lease as the heartbeat hears signals, so a streaming model sees it between two pieces
    while the step's thread is inside the call.
    """

    def __init__(self, live: Live, lease: Lease) -> None:
        self._live = live
        self._lease = lease
        self._forced = False

    def set(self) -> None:
        """Stop the call whatever the signals say."""
        self._forced = True
        self._lease.wake.set()

    def is_set(self) -> bool:
        """Whether the call should stop now."""
        lease = self._lease
        return self._forced or lease.abort.is_set() or (lease.steer > self._live.cursor and not self._live.emitted)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the call should stop (True) or ``timeout`` passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            if self._lease.wake.wait(remaining):
                self._lease.wake.clear()
        return True


class Live:
    """The live side of one step: publishes signals while the run is watched; a model call's listener."""

    def __init__(self, signals: Signals | None, lease: Lease) -> None:
        self._signals = signals
        self._lease = lease
        #: Inbox cursor of the transcript the model is asked about: a steer past it cuts a silent call short.
        self.cursor = 0
        #: Whether the current model call emitted text or a tool call yet.
        self.emitted = False
        #: Set when the current model call should stop (see ``_CutShort``).
        self.cancelled = _CutShort(self, lease)
        #: Events for the step's next save that no transcript change carries (``agent.drift``).
        self.pending: list[EventDraft] = []
        #: Whether the run's agent has ``on_run_end`` hooks (a save that ends the input then owes them).
        self.end_hooks = False
        #: The saved checkpoint that ended the input and owes ``on_run_end`` hooks, once one was saved.
        self.end_owed: Checkpoint | None = None
        self._claimed_at: datetime | None = None
        self._claimed_mono = 0.0
        #: Runs ``(id, agent)`` a model slot this step freed or found free went to: each is sent a step once the
        #: lease is released.
        self.woken: list[tuple[str, str | None]] = []
        #: The step began on a run paused on approvals and saved it paused: a decision that came meanwhile found
        #: the lease held (its step dropped as busy), so the run is read again once the lease is released.
        self.paused_through = False

    def claimed(self, now: datetime | None, end_hooks: bool) -> None:
        """The step claimed the run at ``now`` (Postgres's clock); its agent has ``on_run_end`` hooks or not."""
        self._claimed_at, self._claimed_mono = now, time.monotonic()
        self.end_hooks = end_hooks

    def db_now(self) -> datetime:
        """Postgres's time now: the claim's time plus what this process measured since (its own clock without one)."""
        if self._claimed_at is None:
            return datetime.now(UTC)
        return self._claimed_at + timedelta(seconds=time.monotonic() - self._claimed_mono)

    @property
    def watched(self) -> bool:
        """Whether a consumer reads the run's events (as of the lease's last renewal)."""
        return self._signals is not None and self._lease.watched

    def emit(self, event_type: str, data: dict[str, Any]) -> None:
        """Publish a live signal while someone watches."""
        if self._signals is not None and self._lease.watched:
            at = datetime.now(UTC).isoformat()
            self._signals.publish(self._lease.session_id, payloads.dumps({"type": event_type, "data": data, "at": at}))

    def saved(self, events_written: int, ended: bool = False) -> None:
        """A save wrote durable events (a ``run.done`` among them when ``ended``): wake the consumers.

        They read the events from Postgres. The note says when the save ended the input: a reader that found that
        ``run.done`` first knows from it that it heard every live signal of the input (they came before the note).
        """
        if events_written and self._signals is not None and self._lease.watched:
            note = '{"saved": true, "ends": true}' if ended else '{"saved": true}'
            self._signals.publish(self._lease.session_id, note)

    def tool_start(self, call: ToolCall) -> None:
        """A call starts running."""
        self.emit("tool.start", {"tool_call_id": call.id, "tool_name": call.name, "args": call.args})

    # -- the model's listener ---------------------------------------------------------------

    def text(self, delta: str) -> None:
        """A piece of the model's text."""
        self.emitted = True
        self.emit("text.delta", {"text": delta})

    def tool_call(self, call_id: str, name: str) -> None:
        """A tool call of the model's answer started to stream."""
        self.emitted = True
