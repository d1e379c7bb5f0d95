"""Where the drawing of a run's timeline puts its bars, from stored times alone (no services, no browser)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from producer.ui import drawing
from store.events import Event
from store.records import Approval, Checkpoint, LastError, Message, ToolCall

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _event(seq: int, kind: str, seconds: float, **data: Any) -> Event:
    return Event(run_id="r-1", seq=seq, type=kind, at=_at(seconds), data=data)


def _run(*messages: Message, **fields: Any) -> Checkpoint:
    return Checkpoint(session_id="r-1", agent="a", messages=list(messages), **fields)


def _turn(*call_ids: str) -> Message:
    return Message(role="assistant", content="", tool_calls=[ToolCall(id=c, name="dig", args={}) for c in call_ids])


def _by_key(bars: list[drawing.Bar]) -> dict[tuple[str, str], drawing.Bar]:
    return {(bar.kind, bar.key): bar for bar in bars}


def test_a_step_and_a_call_end_at_their_save_and_last_their_recorded_duration() -> None:
    events = [
        _event(0, "run.start", 0),
        _event(1, "step.done", 2, step=1, duration_ms=1500),
        _event(2, "tool.done", 5, tool_call_id="c1", tool_name="dig", duration_ms=2500),
    ]
    found = _by_key(drawing.bars(_run(_turn("c1"), status="finished"), events, [], now=_at(60)))
    assert (found["step", "1"].start, found["step", "1"].end) == (_at(0.5), _at(2))
    assert (found["tool", "c1"].start, found["tool", "c1"].end) == (_at(2.5), _at(5))
    assert found["tool", "c1"].label == "tool dig"
    assert not any(bar.open for bar in found.values())


def test_a_step_saved_without_a_duration_starts_at_the_previous_event_or_the_end_of_a_wait_since() -> None:
    approval = Approval(
        approval_id="ap-1",
        session_id="r-1",
        tool_call_id="c1",
        tool_name="dig",
        agent="a",
        status="approved",
        created_at=_at(3),
        decided_at=_at(7),
    )
    events = [
        _event(0, "run.start", 0),
        _event(1, "step.done", 2, step=1),
        _event(2, "approval.requested", 3),
        _event(3, "step.done", 8, step=2),
    ]
    found = _by_key(drawing.bars(_run(status="finished"), events, [approval], now=_at(60)))
    assert (found["step", "1"].start, found["step", "1"].end) == (_at(0), _at(2))
    assert (found["approval", "ap-1"].start, found["approval", "ap-1"].end) == (_at(3), _at(7))
    assert (found["step", "3"].start, found["step", "3"].end) == (_at(7), _at(8))


def test_what_still_goes_on_runs_to_now_and_is_drawn_open() -> None:
    now = _at(30)
    pending = Approval(
        approval_id="ap-2", session_id="r-1", tool_call_id="c2", tool_name="stamp", agent="a", created_at=_at(4)
    )
    events = [
        _event(0, "step.done", 2, step=1, duration_ms=1000),
        _event(1, "subagent.start", 3, tool_call_id="c3", child_run_id="r-1.task-0123456789abcdef", agent="digger"),
        _event(2, "approval.requested", 4),
    ]
    run = _run(
        _turn("c1", "c2", "c3"),
        status="awaiting-approval",
        approval_ids=["ap-2"],
        delegated={"c3": "r-1.task-0123456789abcdef"},
    )
    found = _by_key(drawing.bars(run, events, [pending], now=now))
    assert found["approval", "ap-2"].open and found["approval", "ap-2"].end == now
    child = found["children", "r-1.task-0123456789abcdef"]
    assert child.open and (child.start, child.end) == (_at(3), now) and child.run_id == "r-1.task-0123456789abcdef"
    assert ("tool", "c1") not in found, "a call waiting with its run on a person is not drawn as running"


def test_a_call_of_the_last_turn_without_a_result_runs_from_the_turns_save_until_now() -> None:
    events = [_event(0, "step.done", 2, step=1, duration_ms=1000)]
    found = _by_key(drawing.bars(_run(_turn("c1")), events, [], now=_at(9)))
    running = found["tool", "c1"]
    assert running.open and (running.start, running.end) == (_at(2), _at(9))


def test_a_retry_waits_from_the_failure_until_the_next_work_or_until_now_while_it_still_waits() -> None:
    retried = [
        _event(0, "provider.retry", 1, code="LOUSHO_PROVIDER_REQUEST_FAILED", delay_s=0.5),
        _event(1, "step.done", 4, step=1, duration_ms=1000),
    ]
    found = _by_key(drawing.bars(_run(status="finished"), retried, [], now=_at(60)))
    assert (found["retry", "0"].start, found["retry", "0"].end) == (_at(1), _at(3))
    assert not found["retry", "0"].open

    waiting = [_event(0, "error", 1, code="LOUSHO_AGENT_EXECUTION_FAILED", retryable=True)]
    run = _run(last_error=LastError(code="LOUSHO_AGENT_EXECUTION_FAILED", retryable=True))
    still = _by_key(drawing.bars(run, waiting, [], now=_at(5)))["retry", "0"]
    assert still.open and still.end == _at(5)

    parked = [_event(0, "error", 1, code="LOUSHO_X", retryable=False)]
    assert drawing.bars(_run(), parked, [], now=_at(5)) == []


def test_the_drawing_places_bars_on_one_axis_widens_the_shortest_and_keeps_the_latest() -> None:
    found = [
        drawing.Bar("step", "1", "step 1", _at(0), _at(10)),
        drawing.Bar("tool", "c1", "tool", _at(5), _at(7.5)),
        drawing.Bar("tool", "c2", "tool", _at(19.99), _at(20)),
    ]
    drawn = drawing.draw(found)
    assert drawn is not None
    assert (drawn.origin, drawn.end) == ("2026-03-01T12:00:00.000Z", "2026-03-01T12:00:20.000Z")
    placed = {p.bar.key: p for p in drawn.bars}
    assert (placed["1"].x, placed["1"].width) == (0, 50)
    assert (placed["c1"].x, placed["c1"].width) == (25, 12.5)
    assert placed["c2"].width == drawing.MIN_WIDTH and placed["c2"].x + placed["c2"].width <= 100
    assert [p.y for p in drawn.bars] == sorted({p.y for p in drawn.bars})
    assert drawing.draw([]) is None

    many = [drawing.Bar("tool", str(n), "tool", _at(n), _at(n + 1)) for n in range(drawing.MAX_BARS + 7)]
    kept = drawing.draw(many)
    assert kept is not None and kept.dropped == 7 and kept.bars[0].bar.key == "7"
