"""A run's timeline drawn: each model step, tool call and wait (approval, retry, children) as a bar on one time axis.

Bars come from what the store keeps: the run's durable events (a step's and a call's save time and duration, a
retry's failure, a child's start and settling), its approvals' creation and decision, and for what is still going
on, the time of drawing. ``_drawing.html`` draws them as SVG. This module reads and writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from store.events import Event
from store.records import Approval, Checkpoint

#: What a bar stands for: a model turn, a tool call, or a wait on a person, a retry time, or a child run.
BarKind = Literal["step", "tool", "approval", "retry", "children"]
#: Most bars one drawing holds (the latest are kept; the page says how many were left out).
MAX_BARS = 300
#: Narrowest a bar is drawn, in percent of the axis, so that a call of a few milliseconds still shows.
MIN_WIDTH = 0.6
#: Height of one row (a label line over a bar) and where the first row starts, in CSS pixels.
ROW_PX, TOP_PX = 34, 28
_TOOL_EVENTS = ("tool.done", "tool.error")


@dataclass(frozen=True)
class Bar:
    """One thing that took time: from ``start`` to ``end`` (``open``: still going on when drawn, ``end`` is then)."""

    kind: BarKind
    #: What names it within its kind: the seq of a step's or a retry's event, a call's id, an approval's id, a child
    #: run's id.
    key: str
    label: str
    start: datetime
    end: datetime
    open: bool = False
    #: The run a bar leads to (a child's), if any.
    run_id: str | None = None


@dataclass(frozen=True)
class PlacedBar:
    """A bar where the drawing puts it: ``x`` and ``width`` in percent of the axis, ``y`` of its row in pixels."""

    bar: Bar
    x: float
    width: float
    y: int
    start: str
    end: str
    duration: str


@dataclass(frozen=True)
class Tick:
    """A mark of the axis: where (percent) and the time since the axis began."""

    x: float
    label: str
    anchor: str


@dataclass(frozen=True)
class Drawing:
    """What ``_drawing.html`` draws: the axis from ``origin`` to ``end`` and the bars on it, one per row."""

    origin: str
    end: str
    span: str
    bars: list[PlacedBar]
    ticks: list[Tick]
    height: int
    #: Bars left out (older ones) beyond ``MAX_BARS``.
    dropped: int


def _ms(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def _waits(run_events: Sequence[Event], approvals: Iterable[Approval], now: datetime) -> list[Bar]:
    """The run's waits on a person and on its children (retries are placed once the work around them is)."""
    found: list[Bar] = []
    for approval in approvals:
        if approval.created_at is None:
            continue
        what = "question" if approval.kind == "question" else f"approval of {approval.tool_name}"
        pending = approval.status == "pending"
        end = now if pending or approval.decided_at is None else approval.decided_at
        found.append(
            Bar(
                "approval",
                approval.approval_id,
                f"waits on a person: {what}",
                approval.created_at,
                max(end, approval.created_at),
                open=pending,
            )
        )
    settled = {
        (str(e.data.get("tool_call_id")), str(e.data.get("child_run_id"))): e.at
        for e in run_events
        if e.type == "subagent.done"
    }
    for event in run_events:
        child = event.data.get("child_run_id")
        if event.type != "subagent.start" or not isinstance(child, str):
            continue
        ended = settled.get((str(event.data.get("tool_call_id")), child))
        found.append(
            Bar(
                "children",
                child,
                f"waits on child run: {event.data.get('agent') or 'sub-agent'}",
                event.at,
                max(ended or now, event.at),
                open=ended is None,
                run_id=child,
            )
        )
    return found


def _work(checkpoint: Checkpoint, run_events: Sequence[Event], waits: Sequence[Bar], now: datetime) -> list[Bar]:
    """The run's model turns and tool calls, each ending at its save and lasting its recorded duration.

    A turn saved without a duration (an earlier release) starts at the run's previous event, or at the end of a
    wait between the two. Calls of the last turn with no result yet run on until now, from the turn's save.
    """
    found: list[Bar] = []
    names = {call.id: call.name for m in checkpoint.messages if m.role == "assistant" for call in m.tool_calls or ()}
    previous: datetime | None = None
    last_turn: datetime | None = None
    turns = 0
    for event in run_events:
        duration = _ms(event.data.get("duration_ms"))
        if event.type == "step.done":
            if duration is not None:
                start: datetime | None = event.at - timedelta(milliseconds=duration)
            else:
                start = max(
                    [w.end for w in waits if w.end <= event.at] + ([previous] if previous else []), default=None
                )
            turns += 1
            if start is not None:
                found.append(Bar("step", str(event.seq), f"step {turns}: model", start, event.at))
            last_turn = event.at
        elif event.type in _TOOL_EVENTS and duration is not None:
            call_id = str(event.data.get("tool_call_id"))
            name = event.data.get("tool_name") or names.get(call_id) or "tool"
            found.append(
                Bar(
                    "tool",
                    call_id,
                    f"tool {name}" + (" (error)" if event.type == "tool.error" else ""),
                    event.at - timedelta(milliseconds=duration),
                    event.at,
                )
            )
        previous = event.at
    found.extend(_running_calls(checkpoint, waits, last_turn, now))
    return found


def _running_calls(
    checkpoint: Checkpoint, waits: Sequence[Bar], last_turn: datetime | None, now: datetime
) -> list[Bar]:
    """Calls of the last turn that have no result and wait on nothing: they run now (or are about to)."""
    if last_turn is None or checkpoint.status != "in-progress" or checkpoint.aborted or checkpoint.last_error:
        return []
    turns = [m for m in checkpoint.messages if m.role == "assistant"]
    done = {m.tool_call_id for m in checkpoint.messages if m.role == "tool"}
    delegated = set((checkpoint.delegated or {}).keys())
    return [
        Bar("tool", call.id, f"tool {call.name} (under way)", last_turn, max(now, last_turn), open=True)
        for call in (turns[-1].tool_calls or () if turns else ())
        if call.id not in done and call.id not in delegated and not any(w.open for w in waits)
    ]


def _retries(checkpoint: Checkpoint, run_events: Sequence[Event], work: Sequence[Bar], now: datetime) -> list[Bar]:
    """Each transient failure's wait: from its save until the next work started (until now while it waits)."""
    found: list[Bar] = []
    for index, event in enumerate(run_events):
        retried = event.type == "provider.retry" or (event.type == "error" and event.data.get("retryable") is True)
        if not retried:
            continue
        later = [bar.start for bar in work if bar.start >= event.at]
        if later:
            end, still = min(later), False
        elif index + 1 < len(run_events):
            end, still = run_events[index + 1].at, False
        else:
            end, still = max(now, event.at), checkpoint.status == "in-progress"
        code = event.data.get("code") or "an error"
        found.append(Bar("retry", str(event.seq), f"waits to retry after {code}", event.at, end, open=still))
    return found


def bars(
    checkpoint: Checkpoint, run_events: Sequence[Event], approvals: Iterable[Approval], now: datetime | None = None
) -> list[Bar]:
    """Every bar of the run, by start time: its turns, calls, and waits on people, retries and children.

    ``run_events`` are the run's durable events in seq order; ``approvals`` those the run asked for (decided ones
    included); ``now`` ends what still goes on (the current time by default).
    """
    now = now or datetime.now(UTC)
    waits = _waits(run_events, approvals, now)
    work = _work(checkpoint, run_events, waits, now)
    found = [*work, *waits, *_retries(checkpoint, run_events, work, now)]
    order = {"retry": 0, "approval": 1, "children": 2, "step": 3, "tool": 4}
    return sorted(found, key=lambda bar: (bar.start, order[bar.kind], bar.key))


def stamp(when: datetime) -> str:
    """``when`` as ISO-8601 UTC to the millisecond, ending in ``Z`` (what a bar's ``data-start`` carries)."""
    return when.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def duration_text(seconds: float) -> str:
    """A duration for people: milliseconds under a second, seconds under two minutes, then minutes or hours."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def draw(found: Sequence[Bar]) -> Drawing | None:
    """The drawing of ``found`` (None when there is nothing to draw): one axis from the first start to the last end.

    Only the latest ``MAX_BARS`` are kept. A bar's left edge stands at its start; its width is its duration, or
    ``MIN_WIDTH`` when that is narrower (then it ends no further right than the axis).
    """
    if not found:
        return None
    kept = list(found[-MAX_BARS:])
    origin = min(bar.start for bar in kept)
    end = max(bar.end for bar in kept)
    span = max((end - origin).total_seconds(), 0.001)
    placed = []
    for row, bar in enumerate(kept):
        width = max((bar.end - bar.start).total_seconds() / span * 100, MIN_WIDTH)
        # A bar widened to be seen near the end of the axis moves left by at most that widening.
        x = min((bar.start - origin).total_seconds() / span * 100, 100 - width)
        placed.append(
            PlacedBar(
                bar,
                round(x, 4),
                round(width, 4),
                TOP_PX + row * ROW_PX,
                stamp(bar.start),
                stamp(bar.end),
                duration_text((bar.end - bar.start).total_seconds()),
            )
        )
    ticks = [
        Tick(
            share * 100,
            "0" if share == 0 else "+" + duration_text(span * share),
            "start" if share == 0 else "end" if share == 1 else "middle",
        )
        for share in (0, 0.25, 0.5, 0.75, 1)
    ]
    return Drawing(
        stamp(origin),
        stamp(end),
        duration_text(span),
        placed,
        ticks,
        TOP_PX + len(kept) * ROW_PX + 4,
        len(found) - len(kept),
    )


__all__ = [
    "MAX_BARS",
    "MIN_WIDTH",
    "Bar",
    "BarKind",
    "Drawing",
    "PlacedBar",
    "Tick",
    "bars",
    "draw",
    "duration_text",
    "stamp",
]
