"""A tool batch's checkpoint as its results settle: every change is one fenced save, under one lock.

What the calls of a batch share while they run (``worker.batch``): the checkpoint, the business state each call
starts from, the lease's signals (abort, steer) heard between calls, and what is fitted into each save.
"""

from __future__ import annotations

import threading
from typing import Any

from store import errors, payloads
from store.records import Approval, Checkpoint, EventDraft, Lease, Message, ToolCall
from worker import abort, business, handoffs, machine, once, subagents
from worker import live as live_events
from worker.agents import (
    Agent,
)
from worker.context import StepDeps, save
from worker.faults import crash_point
from worker.live import Live


class Batch:
    """The checkpoint as results settle; every change is a fenced save under one lock."""

    def __init__(self, deps: StepDeps, lease: Lease, checkpoint: Checkpoint, unsettled: int, live: Live) -> None:
        self.deps = deps
        self.lease = lease
        self.checkpoint = checkpoint
        self.status_before = checkpoint.status
        self.live = live
        self.lock = threading.Lock()
        self.closed = False
        self.fenced = False
        self.unsettled = unsettled
        self.budget = payloads.MAX_TURN_RESULTS
        self.appended = 0
        self.measured = False
        #: Every call's ``ctx.cancelled``: the lease's abort doorbell, set by the heartbeat as it renews the
        #: lease. A doorbell heard while the step holds the lease is real (an abort is stored before it rings,
        #: and only the lease holder settles it); ``hear`` still confirms it before the run is stopped.
        self.cancelled = lease.abort
        self.aborting = False
        self.abort_checked = False
        self.hearing = threading.Lock()
        self.steered = False
        #: The steer was deferred to after a pause's decisions: the calls it held back run then.
        self.steer_deferred = False
        self.cursor = checkpoint.inbox_cursor
        #: Child run id -> the state this step found a delegated child in while it could not give a result yet.
        self.seen: dict[str, str] = {}
        #: Call id -> the business state its ``pre_tool_call`` hooks wrote (saved with its result, unless the call
        #: writes again).
        self.writes: dict[str, business.Write] = {}

    def state_for(self, call_id: str) -> Any:
        """The business state a call starts from: its hooks' write, else the run's as the batch saved it last."""
        written = self.writes.get(call_id)
        return written.value if written is not None else self.checkpoint.business_state

    def hear(self) -> None:
        """Act on the signals the lease heard: a confirmed abort, a steer past this batch's input."""
        if self.lease.abort.is_set() and not self.abort_checked:
            with self.hearing:  # a second caller waits for the answer instead of taking "not yet" for "no"
                if not self.abort_checked:
                    self.aborting = abort.confirmed(self.deps, self.lease)
                    self.abort_checked = True
        if self.lease.steer > self.cursor and not self.steer_deferred:
            self.steered = True

    def may_start(self) -> bool:
        """Whether another call may start: the batch is not closed, fenced out, aborting or steered away."""
        self.hear()
        return not (self.closed or self.fenced or self.lease.lost.is_set() or self.aborting or self.steered)

    def _write(
        self, updated: Checkpoint, approvals: list[Approval] | None = None, events: list[EventDraft] | None = None
    ) -> bool:
        try:
            self.checkpoint = save(
                self.deps,
                updated,
                approvals=approvals or (),
                events=events or (),
                status_before=self.status_before,
                live=self.live,
            )
        except errors.FencedOutError:
            self.fenced = True
            self.lease.lost.set()
            return False
        return True

    def _fit(self, result: Message) -> Message:
        """``result`` within its share of what the batch may still append (the largest results are cut)."""
        if not isinstance(result.content, str):
            return result
        size = payloads.text_size(result.content)
        if not self.measured and self.appended + size > payloads.MAX_TURN_RESULTS // 8:
            # Only a large batch pays for measuring the checkpoint it is appended to.
            stored = len(payloads.dumps(self.checkpoint.document()).encode("utf-8"))
            room = payloads.MAX_CHECKPOINT - stored - payloads.MAX_TURN_RESULTS // 16
            self.budget = max(min(payloads.MAX_TURN_RESULTS, room), 0)
            self.measured = True
        share = max((self.budget - self.appended) // max(self.unsettled, 1), 256)
        self.unsettled -= 1
        if size > share:
            result = result.model_copy(update={"content": payloads.fit_text(result.content, share)})
            size = payloads.text_size(result.content)
        self.appended += size
        return result

    def settle(
        self,
        result: Message,
        duration_ms: float | None = None,
        events: tuple[EventDraft, ...] = (),
        write: business.Write | None = None,
    ) -> None:
        """Save a call's result, with the business state the call (or its hooks) wrote, in one fenced save.

        A write is kept whatever the result says (an error the tool raised after writing, or ``cancelled`` when
        the run was aborted meanwhile): the code that wrote it ran. ``write`` None: the hooks' write, if any.
        """
        self.hear()
        with self.lock:
            if self.closed or self.fenced:
                return
            call_id = result.tool_call_id or ""
            hooks_wrote = self.writes.pop(call_id, None)
            write = write or hooks_wrote
            if self.aborting and not result.is_error:
                # It returned after the abort: the run stops with this call cancelled.
                result = machine.cancelled(ToolCall(id=call_id, name=result.name or ""))
            crash_point("after_tool_effect_before_result_save", self.checkpoint.session_id)
            fitted = self._fit(result)
            updated = machine.record_tool_result(self.checkpoint, fitted)
            drafts = [*events, live_events.tool_result(fitted, duration_ms)]
            if write is not None:
                updated = updated.model_copy(update={"business_state": write.value})
                drafts.append(business.changed(write, tool_call_id=call_id, tool_name=result.name))
            if self._write(updated, events=drafts):
                crash_point("between_results", self.checkpoint.session_id)

    def settle_child(self, call: ToolCall, result: Message, child: str, state: Checkpoint | None) -> None:
        """Record a delegated call's result with its child's usage folded into the run's."""
        with self.lock:
            if self.closed or self.fenced:
                return
            fitted = self._fit(result)
            updated = machine.record_tool_result(self.checkpoint, fitted)
            updated = updated.model_copy(update={"usage": updated.usage + subagents.usage_of(state)})
            self._write(updated, events=[live_events.tool_result(fitted, None), subagents.done(call, child, state)])

    def settle_background(self, call: ToolCall, result: Message, child: str, event: EventDraft) -> None:
        """Record a background task's start (its result, given at once) with the child in ``background``."""
        with self.lock:
            if self.closed or self.fenced:
                return
            fitted = self._fit(result)
            updated = machine.record_tool_result(self.checkpoint, fitted)
            updated = updated.model_copy(update={"background": [*(updated.background or []), child]})
            self._write(updated, events=[live_events.tool_result(fitted, None), event])

    def delegate(self, delegated: dict[str, str], events: list[EventDraft], paused_on: list[str]) -> None:
        """Save which calls wait on which children (``waiting`` while any has no result yet).

        ``paused_on``: approvals children wait on; the run is paused on them (``awaiting-approval``) meanwhile.
        """
        with self.lock:
            if self.closed or self.fenced:
                return
            open_calls = {c.id for c in self.checkpoint.pending_tool_calls}
            kept = {call_id: child for call_id, child in delegated.items() if call_id in open_calls}
            update: dict[str, Any] = {"delegated": kept or None, "waiting": bool(kept)}
            if paused_on:
                update.update(status="awaiting-approval", approval_ids=paused_on)
            elif self.checkpoint.status == "awaiting-approval" and self.checkpoint.waiting:
                update.update(status="in-progress", approval_ids=[])
            updated = self.checkpoint.model_copy(update=update)
            if updated == self.checkpoint and not events:
                return
            self._write(updated, events=events)

    def hand_off(self, call: ToolCall, entry: Agent, target: Agent) -> None:
        """Record a handoff: its result and the run moved to ``target`` (with its fingerprint), in one save."""
        with self.lock:
            if self.closed or self.fenced:
                return
            result = machine.tool_message(call, {"transferred_to": target.name, "from": entry.name})
            moved = machine.record_tool_result(self.checkpoint, self._fit(result)).model_copy(
                update={
                    "active_agent": None if target.name == self.checkpoint.agent else target.name,
                    "fingerprint": self.deps.fingerprint(handoffs.as_target(entry, target)),
                }
            )
            self._write(
                moved, events=[live_events.tool_result(result, None), live_events.handoff(entry.name, target.name)]
            )

    def mark_started(self, call: ToolCall, rerun: once.Rerun | None = None) -> bool:
        """Save ``call`` as started before it runs (a call run again: with the decision it spends, and its events).

        False when the batch can no longer write (the call must not run).
        """
        with self.lock:
            if self.closed or self.fenced:
                return False
            updated = machine.mark_started(self.checkpoint, call.id)
            events: tuple[EventDraft, ...] = ()
            if rerun is not None:
                events = rerun.events
                if rerun.consumes is not None:
                    updated = machine.drop_approval(updated, rerun.consumes)
            if updated is self.checkpoint and not events:
                return True  # marked by an earlier start: nothing new to save
            return self._write(updated, events=list(events))

    def pause(self, approvals: list[Approval], decided: dict[str, str], events: list[EventDraft]) -> bool:
        """Pause on ``approvals``, keeping the decisions (approval id -> call id) of calls still without a result."""
        with self.lock:
            if self.closed or self.fenced:
                return False
            open_calls = {c.id for c in self.checkpoint.pending_tool_calls}
            kept = [a for a in self.checkpoint.approval_ids if decided.get(a) in open_calls]
            paused = machine.pause(self.checkpoint, [a.approval_id for a in approvals] + kept)
            return self._write(paused, approvals, events)
