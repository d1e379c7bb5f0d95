"""What the run pages show: a run's status, its timeline, its approvals, a page of the runs list, a comparison.

Turns checkpoints, durable events, approvals and trajectories into plain template data; it reads and writes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from producer.trajectories import TrajectoryComparison, TrajectoryStep
from store import records
from store.events import Event
from store.records import Approval, Checkpoint, PendingRun

#: The states the runs list filters by (``""``: any): the runs' one vocabulary (``records.LISTED_STATES``).
STATUSES: tuple[str, ...] = ("", *records.LISTED_STATES)
#: States after which a run does not move by itself: its page stops following it.
SETTLED = frozenset({"finished", "parked", "aborted", "budget-exceeded"})
#: States in which a run can be aborted, and resumed.
ABORTABLE = frozenset({"running", "waiting", "awaiting-approval", "retrying"})
RESUMABLE = frozenset({"parked", "aborted", "budget-exceeded", "retrying"})
PAGE_SIZE = 50
#: Filter words of earlier releases (links kept from them), and the state each stands for.
_ALIASES = {**records.STATE_ALIASES, "in-progress": "running"}


def status_of(run: Checkpoint | PendingRun | records.ListedRun) -> str:
    """The state a page shows (``records.ListedState``): where the run stands, in the runs' one vocabulary."""
    if isinstance(run, PendingRun):  # a run whose checkpoint cannot be read
        return "parked"
    if isinstance(run, records.ListedRun):
        return run.state
    if run.status == "finished" and not run.aborted:
        return "finished"
    return records.checkpoint_state(run)


def status_filter(given: str) -> str:
    """The state filter of the runs list a ``status`` query stands for (``""``: any, also for an unknown word)."""
    status = _ALIASES.get(given, given)
    return status if status in STATUSES else ""


def iso(when: datetime | None) -> str | None:
    """``when`` as ISO-8601 UTC ending in ``Z`` (what ``<time datetime>`` carries)."""
    if when is None:
        return None
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def as_text(value: Any) -> str:
    """A message content or tool result as display text: strings as they are, anything else as indented JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return json.dumps(parsed, indent=2, ensure_ascii=False) if isinstance(parsed, (dict, list)) else value
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


@dataclass
class RunRow:
    """One row of the runs list."""

    run_id: str
    agent: str
    status: str
    updated: str | None


def states_of(status: str) -> tuple[str, ...] | None:
    """The listing states a status filter of the runs list keeps (None: any)."""
    return (status,) if status else None


def run_rows(page: records.RunsPage) -> list[RunRow]:
    """The rows of a page of the runs list, as the store listed them (newest first)."""
    return [RunRow(run.session_id, run.agent, status_of(run), iso(run.updated_at)) for run in page.items]


@dataclass
class ToolCallView:
    """One tool call of a step with its result."""

    call_id: str
    name: str
    args: str
    result: str | None
    is_error: bool = False
    duration_ms: float | None = None
    #: The child run a ``task`` call started, whose result this is.
    child_id: str | None = None


@dataclass
class TimelineItem:
    """An input message (``kind="input"``) or a model turn (``kind="step"``, numbered from 1)."""

    kind: str
    text: str
    number: int = 0
    calls: list[ToolCallView] = field(default_factory=list)
    usage: dict[str, int] | None = None
    at: str | None = None
    #: How long the turn took, from the model call to its save (recorded by the worker).
    duration_ms: float | None = None


def _step_key(calls: Sequence[str], text: Any) -> tuple[Any, ...]:
    return tuple(calls) if calls else ("text", text if isinstance(text, str) else None)


def timeline(
    checkpoint: Checkpoint, run_events: Sequence[Event], children: dict[str, str] | None = None
) -> list[TimelineItem]:
    """The run's inputs and steps in order; durations, usage and times come from its durable events if kept.

    ``children`` maps a ``task`` call's id to the child run it started (``tree.children_of_calls``).
    """
    children = children or {}
    results = {m.tool_call_id: m for m in checkpoint.messages if m.role == "tool"}
    durations: dict[str, float] = {}
    turns: dict[tuple[Any, ...], list[Event]] = {}
    for event in run_events:
        if event.type in ("tool.done", "tool.error") and isinstance(event.data.get("duration_ms"), (int, float)):
            durations[str(event.data.get("tool_call_id"))] = float(event.data["duration_ms"])
        elif event.type == "step.done":
            ids = [str(c.get("id")) for c in event.data.get("tool_calls") or ()]
            turns.setdefault(_step_key(ids, event.data.get("text")), []).append(event)
    items: list[TimelineItem] = []
    for message in checkpoint.messages:
        if message.role == "user":
            items.append(TimelineItem("input", as_text(message.content)))
        elif message.role == "assistant":
            calls = []
            for call in message.tool_calls or ():
                result = results.get(call.id)
                calls.append(
                    ToolCallView(
                        call.id,
                        call.name,
                        json.dumps(call.args, indent=2, ensure_ascii=False, default=str)
                        if call.invalid_args is None
                        else call.invalid_args,
                        None if result is None else as_text(result.content),
                        bool(result and result.is_error),
                        durations.get(call.id),
                        children.get(call.id),
                    )
                )
            matched = turns.get(_step_key([c.id for c in message.tool_calls or ()], message.content))
            turn = matched.pop(0) if matched else None
            usage = turn.data.get("usage") if turn is not None else None
            took = turn.data.get("duration_ms") if turn is not None else None
            items.append(
                TimelineItem(
                    "step",
                    as_text(message.content) if message.content else "",
                    sum(i.kind == "step" for i in items) + 1,
                    calls,
                    {"input": int(usage.get("input_tokens", 0)), "output": int(usage.get("output_tokens", 0))}
                    if isinstance(usage, dict)
                    else None,
                    iso(turn.at) if turn is not None else None,
                    float(took) if isinstance(took, (int, float)) else None,
                )
            )
    return items


def drift_notes(run_events: Sequence[Event]) -> list[str]:
    """One line per ``agent.drift`` event: what changed in the agent since the run was saved."""
    notes = []
    for event in run_events:
        if event.type == "agent.drift":
            changed = ", ".join(sorted(str(k) for k in event.data)) or "the agent"
            notes.append(f"The agent changed since this run was saved ({changed}).")
    return notes


@dataclass
class ApprovalView:
    """An approval as the run page and the inbox show it."""

    approval_id: str
    run_id: str
    agent: str
    kind: str
    tool_name: str
    args: str
    status: str
    question: str | None
    options: list[str]
    note: str | None
    answer: str | None
    created: str | None


def approval_view(approval: Approval) -> ApprovalView:
    """The display fields of ``approval``."""
    return ApprovalView(
        approval.approval_id,
        approval.session_id,
        approval.agent,
        approval.kind,
        approval.tool_name,
        json.dumps(approval.args, indent=2, ensure_ascii=False, default=str),
        approval.status,
        approval.question,
        list(approval.options or ()),
        approval.note,
        approval.answer,
        iso(approval.created_at),
    )


@dataclass
class CompareStep:
    """One step of a side of a comparison (``index`` from 1, as ``compare_trajectories`` and history count)."""

    index: int
    text: str
    calls: list[dict[str, str]]
    diverged: bool


def compare_sides(comparison: TrajectoryComparison) -> tuple[list[CompareStep], list[CompareStep]]:
    """Both sides of ``comparison``, the step where they diverge marked (``index`` counts from 1, as history does)."""

    def side(steps: list[TrajectoryStep]) -> list[CompareStep]:
        at = comparison.diverged_at
        return [
            CompareStep(
                index,
                step.text or "",
                [
                    {
                        "name": str(c["name"]),
                        "args": json.dumps(c["args"], ensure_ascii=False, default=str),
                        "result": as_text(c["result"]),
                    }
                    for c in step.tool_calls
                ],
                at is not None and index == at,
            )
            for index, step in enumerate(steps, start=1)
        ]

    return side(comparison.a), side(comparison.b)


__all__ = [
    "ABORTABLE",
    "PAGE_SIZE",
    "RESUMABLE",
    "SETTLED",
    "STATUSES",
    "ApprovalView",
    "CompareStep",
    "RunRow",
    "TimelineItem",
    "ToolCallView",
    "approval_view",
    "as_text",
    "compare_sides",
    "drift_notes",
    "iso",
    "run_rows",
    "states_of",
    "status_filter",
    "status_of",
    "timeline",
]
