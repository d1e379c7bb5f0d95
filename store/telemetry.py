"""What each step did, recorded once for everything that shows it: task results, metrics, traces and logs.

The step code notes facts as they happen (``note``, ``model_call``, ``tool_call``) into the ``StepReport`` of
the step running in this context; ``step`` opens one around a Celery task and hands the finished report to
the attached sinks (``store.metrics``, ``worker.tracing``). Nothing here imports a metrics or tracing
library: with no sink attached a report costs a few attribute writes. Reports carry names, counts, codes and
timings, never a prompt, an argument or an output (RELIABILITY section 5).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from store.records import Checkpoint

log = logging.getLogger("lousho.telemetry")

#: What a step is, as its name in Flower and its ``kind`` label say.
MODEL_TURN = "model turn"
TOOL_BATCH = "tool batch"
RESUME = "resume after approval"
NEW_INPUT = "new input"
RECOVERY = "recovery"
RETRY = "retry"
RESUME_RUN = "resume"
ABORT = "abort"
CHILDREN_SETTLED = "sub-agents settled"
SLOT_FREED = "model slot freed"
#: What a step message may be named for: what the step does when the sender knows it, else why it was sent.
KINDS = (MODEL_TURN, TOOL_BATCH, RESUME, NEW_INPUT, RECOVERY, RETRY, RESUME_RUN, ABORT, CHILDREN_SETTLED, SLOT_FREED)
#: Longest agent name shown in a step's name (agent names are limited to 64 characters anyway).
_NAME_MAX = 64


def step_name(agent: str | None, kind: str) -> str:
    """The name a step message goes by in Flower and the worker's log: ``"<agent>: <kind>"``."""
    return f"{(agent or 'lousho')[:_NAME_MAX]}: {kind}"


def name_sent_events(app: Any) -> None:
    """Make the task-sent events of a Celery ``app`` carry a message's shadow name (``step_name``), as its others do.

    Celery names task-sent after the task (``lousho.advance``) and the worker's events after the shadow name. The
    two travel on different connections; when the task-sent comes last, Flower applies its name over the received
    one (``celery.events.State`` merges every field of a late task-sent) and the step shows as ``lousho.advance``.
    """
    create = app.amqp.create_task_message
    if getattr(create, "names_sent_events", False):
        return

    def create_named(*args: Any, **kwargs: Any) -> Any:
        message = create(*args, **kwargs)
        shadow = message.headers.get("shadow")
        if shadow and message.sent_event is not None:
            message.sent_event["name"] = shadow
        return message

    create_named.names_sent_events = True  # type: ignore[attr-defined]
    app.amqp.create_task_message = create_named


@dataclass
class ModelCallRecord:
    """One model call of a step."""

    model: str
    started_ns: int
    ended_ns: int
    input_tokens: int = 0
    output_tokens: int = 0
    #: Error code when the call raised (``LOUSHO_PROVIDER_ERROR``, an exception's class name), else None.
    error: str | None = None
    finish_reason: str | None = None


@dataclass
class ToolCallRecord:
    """One tool call a step ran (or settled without running: ``outcome`` says which)."""

    tool: str
    call_id: str
    #: ``ok`` or the tool result's error kind (``error``, ``timeout``, ``validation``, ``rejected``, ...).
    outcome: str
    started_ns: int
    ended_ns: int


@dataclass
class StepReport:
    """What one step did: filled in as it runs, read by the sinks once it ended."""

    session_id: str
    seq: int | None = None
    task_id: str | None = None
    #: The agent that ran the step (None until the run was loaded).
    agent: str | None = None
    kind: str = MODEL_TURN
    #: ``worker.context.Outcome`` value, once the step returned.
    outcome: str | None = None
    started_ns: int = 0
    ended_ns: int = 0
    model_calls: list[ModelCallRecord] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    #: Tool calls the model asked for in this step's model turn.
    calls_asked: int = 0
    #: Approvals (and questions) this step opened.
    approvals: int = 0
    #: The step merged new input: a run input started.
    input_started: bool = False
    #: The step's save ended the run's input: ``ended_as`` says how (finished, awaiting-approval, aborted,
    #: budget-exceeded).
    ended_as: str | None = None
    finish_reason: str | None = None
    #: The error the step recorded (a retry or a parked run).
    error_code: str | None = None
    #: Seconds until the run's retry, when the step recorded a retryable failure.
    retry_in: float | None = None
    #: Why a handed-back step was handed back, when it is not a worker of another release that runs it.
    hand_back: str | None = None
    #: The run input's trace context (``worker.tracing``), read from the run or made by this step.
    trace: str | None = None
    #: Child runs this step started.
    children: int = 0
    #: ``(tool, outcome)`` of each reconciliation of a ``once`` call the step made (``worker.once``).
    reconciliations: list[tuple[str, str]] = field(default_factory=list)
    #: Why the step waits before its model call (``store.model_limit.WaitReason``), when it does.
    waited: str | None = None
    #: The limit key the step waited on or called under.
    limit_key: str | None = None
    #: The model answered 429/529 with ``Retry-After``: the step cooled its limit key down.
    cooled: bool = False
    #: The run as last loaded or saved by the step (names the next step's kind); not for sinks.
    checkpoint: Checkpoint | None = None
    #: The reports of the steps the same task took after this one (``LOUSHO_CONTINUE_STEPS``), each handed to the
    #: sinks on its own; not for sinks.
    chained: list[StepReport] = field(default_factory=list)

    @property
    def last(self) -> StepReport:
        """The report of the task's last step: this one, or the last it chained."""
        return self.chained[-1] if self.chained else self

    @property
    def seconds(self) -> float:
        """How long the step took."""
        return max(0, self.ended_ns - self.started_ns) / 1e9

    def summary(self) -> str:
        """A short line about the step with no content in it (the task's result in Flower and in logs).

        A task that chained steps lists them, each with the seq it started from (the first ``CHAIN_LISTED``).
        """
        if not self.chained:
            return self._one()
        steps = [self, *self.chained]
        listed = [
            f"#{step.seq} {step._one()}" if step.seq is not None else step._one() for step in steps[:CHAIN_LISTED]
        ]
        if len(steps) > CHAIN_LISTED:
            listed.append(f"... {len(steps) - CHAIN_LISTED} more, the last {steps[-1]._one()}")
        return f"{len(steps)} steps in one task: " + " | ".join(listed)

    def _one(self) -> str:
        outcome = self.outcome or "unknown"
        if outcome == "handed-back" and self.hand_back:
            return f"handed back: {self.hand_back}"
        if outcome == "waiting":
            return _WAITS.get(self.waited or "", "waiting on a model limit")
        if outcome in _DROPPED:
            return _DROPPED[outcome]
        if outcome == "parked":
            return f"parked: {self.error_code or 'LOUSHO_UNKNOWN'}"
        if outcome == "failed":
            return f"retry in {self.retry_in or 0:.1f} s: {self.error_code or 'LOUSHO_UNKNOWN'}"
        head = self._did()
        if outcome == "finished":
            return f"{head}; finished: {self.finish_reason or 'stop'}"
        if outcome == "awaiting-approval":
            return f"{head}; awaiting-approval: {self.approvals} waiting for a person"
        if outcome in _ENDED:
            return f"{head}; {_ENDED[outcome]}"
        if self.ended_as is not None:
            return f"{head}; {self.ended_as}"
        return head

    def _did(self) -> str:
        if self.model_calls:
            asked = self.calls_asked
            return f"model turn: {asked} tool call{'s' if asked != 1 else ''}" if asked else "model turn: answer"
        if self.tool_calls or self.kind in (TOOL_BATCH, RESUME):
            done = len(self.tool_calls)
            return f"tool batch: {done} result{'s' if done != 1 else ''}"
        return self.kind


#: Steps of a chained task its summary names one by one.
CHAIN_LISTED = 24
#: Step outcomes that did no work on the run: counted, never timed or traced.
NO_WORK = frozenset({"busy", "stale", "unknown", "idle", "handed-back", "waiting"})
#: Summaries of steps that did nothing to the run.
_DROPPED = {
    "busy": "busy: another worker holds the run; dropped",
    "stale": "stale: a duplicate of a step already taken; dropped",
    "unknown": "unknown run; dropped",
    "fenced": "fenced out: another holder took the run over; nothing saved",
    "idle": "idle: nothing to do",
    "handed-back": "handed back: a worker of another release runs this step",
}
_WAITS = {
    "slot": "waiting on a model slot",
    "requests": "waiting on the requests per minute of a model limit",
    "tokens": "waiting on the tokens per minute of a model limit",
    "cool-down": "waiting out a model limit's cool-down (429/529)",
}
_ENDED = {"aborted": "aborted", "delegated": "waiting on sub-agents"}


class Sink(Protocol):
    """Receives what steps and sweeps did (a metrics registry, a tracer)."""

    def step_done(self, report: StepReport) -> None:
        """A step ended; ``report`` is complete."""

    def count(self, event: str, amount: int, labels: dict[str, str]) -> None:
        """Something outside a step happened ``amount`` times (``EVENTS`` lists the names)."""


#: ``count`` events: sweeps, schedules and webhook intake.
EVENTS = (
    "sweep.resent",  # runs the recovery sweep sent a step
    "schedule.fired",  # schedule ticks that started a run
    "schedule.skipped",  # ticks skipped because the previous run still ran
    "schedule.missed",  # ticks dropped as too late
    "webhook.accepted",  # deliveries that started or continued a run; labels: agent, source
    "webhook.duplicate",  # deliveries seen before (nothing started); labels: agent, source
    "webhook.refused",  # deliveries refused (signature, size, agent); labels: reason
)

_sinks: list[Sink] = []
_tracer: Any = None
_current: contextvars.ContextVar[StepReport | None] = contextvars.ContextVar("lousho_step", default=None)


def attach(sink: Sink) -> None:
    """Send every report and count to ``sink`` from now on (once per sink)."""
    if sink not in _sinks:
        _sinks.append(sink)


def detach(sink: Sink) -> None:
    """Stop sending to ``sink``."""
    if sink in _sinks:
        _sinks.remove(sink)


def use_traces(maker: Any) -> None:
    """Set what makes a new run input's trace context (``maker()`` returns a string, or None for no trace)."""
    global _tracer
    _tracer = maker


def new_trace() -> str | None:
    """A trace context for a run input that starts now, or None when traces are off."""
    if _tracer is None:
        return None
    try:
        made: str | None = _tracer()
    except Exception:  # a tracer must never stop a step
        log.warning("could not start a trace for a run input", exc_info=True)
        return None
    return made


def current() -> StepReport | None:
    """The report of the step running in this context (None outside ``step``)."""
    return _current.get()


def note(**facts: Any) -> None:
    """Set fields of the current step's report (no-op outside a step)."""
    report = _current.get()
    if report is None:
        return
    for name, value in facts.items():
        setattr(report, name, value)


def model_call(
    model: str,
    started_ns: int,
    *,
    input_tokens: int = 0,
    output_tokens: int = 0,
    error: str | None = None,
    finish_reason: str | None = None,
) -> None:
    """Record a model call that started at ``started_ns`` (``time.time_ns``) and ended now."""
    report = _current.get()
    if report is not None:
        report.model_calls.append(
            ModelCallRecord(model, started_ns, time.time_ns(), input_tokens, output_tokens, error, finish_reason)
        )


def tool_call(tool: str, call_id: str, outcome: str, started_ns: int) -> None:
    """Record a tool call that started at ``started_ns`` (``time.time_ns``) and ended now."""
    report = _current.get()
    if report is not None:
        report.tool_calls.append(ToolCallRecord(tool, call_id, outcome, started_ns, time.time_ns()))


def reconciled(tool: str, outcome: str) -> None:
    """Record what a reconciliation of a ``once`` call of ``tool`` found (``happened``, ``asked``, ...)."""
    report = _current.get()
    if report is not None:
        report.reconciliations.append((tool, outcome))


def count(event: str, amount: int = 1, **labels: str) -> None:
    """Tell the sinks ``event`` happened ``amount`` times (nothing when ``amount`` is 0)."""
    if amount <= 0:
        return
    for sink in list(_sinks):
        try:
            sink.count(event, amount, labels)
        except Exception:  # a sink must never stop a sweep or a webhook
            log.warning("telemetry sink %s failed on %s", type(sink).__name__, event, exc_info=True)


@contextlib.contextmanager
def step(
    session_id: str, seq: int | None = None, task_id: str | None = None, kind: str = MODEL_TURN
) -> Iterator[StepReport]:
    """Collect the report of a step run inside the block, then hand it to the sinks (even if the block raised)."""
    report = StepReport(session_id=session_id, seq=seq, task_id=task_id, kind=kind, started_ns=time.time_ns())
    token = _current.set(report)
    try:
        yield report
    finally:
        _current.reset(token)
        report.ended_ns = report.ended_ns or time.time_ns()  # set already when the task chained a next step
        for sink in list(_sinks):
            try:
                sink.step_done(report)
            except Exception:  # a sink must never fail a step that did its work
                log.warning("telemetry sink %s failed on a step", type(sink).__name__, exc_info=True)


def kind_of(checkpoint: Checkpoint) -> str:
    """What the next step of a run loaded as ``checkpoint`` does (a model turn, a tool batch, a resume)."""
    if checkpoint.status == "awaiting-approval":
        return RESUME
    return TOOL_BATCH if checkpoint.pending_tool_calls else MODEL_TURN


__all__ = [
    "ABORT",
    "CHILDREN_SETTLED",
    "EVENTS",
    "KINDS",
    "MODEL_TURN",
    "NEW_INPUT",
    "NO_WORK",
    "RECOVERY",
    "RESUME",
    "RESUME_RUN",
    "RETRY",
    "TOOL_BATCH",
    "ModelCallRecord",
    "Sink",
    "StepReport",
    "ToolCallRecord",
    "attach",
    "count",
    "current",
    "detach",
    "kind_of",
    "model_call",
    "name_sent_events",
    "new_trace",
    "note",
    "step",
    "step_name",
    "tool_call",
    "use_traces",
]
