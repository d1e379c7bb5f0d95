"""The step task as Flower and the log show it: its name, keyword arguments, result and failure states."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from celery.exceptions import Retry

from store import logs, redaction, telemetry
from store.records import Checkpoint, Message, Status, ToolCall
from worker import tasks
from worker.context import Outcome


def _checkpoint(messages: list[Message], status: Status = "in-progress") -> Checkpoint:
    return Checkpoint(session_id="r-1", agent="support", seq=3, fence=1, status=status, messages=messages)


def test_the_next_step_is_named_for_what_it_does() -> None:
    call = ToolCall(id="c1", name="lookup")
    other = ToolCall(id="c2", name="lookup")
    asked = Message(role="assistant", content=None, tool_calls=[call, other])
    one_result = Message(role="tool", tool_call_id="c1", name="lookup", content="x")
    both = [asked, one_result, Message(role="tool", tool_call_id="c2", name="lookup", content="y")]
    assert telemetry.kind_of(_checkpoint([Message(role="user", content="hi")])) == telemetry.MODEL_TURN
    assert telemetry.kind_of(_checkpoint([asked])) == telemetry.TOOL_BATCH
    assert telemetry.kind_of(_checkpoint([asked, one_result])) == telemetry.TOOL_BATCH
    assert telemetry.kind_of(_checkpoint(both)) == telemetry.MODEL_TURN
    assert telemetry.kind_of(_checkpoint([asked], status="awaiting-approval")) == telemetry.RESUME
    assert telemetry.step_name("support", telemetry.TOOL_BATCH) == "support: tool batch"
    assert telemetry.step_name(None, telemetry.RECOVERY) == "lousho: recovery"


def test_summaries_say_what_a_step_did_in_a_few_words() -> None:
    report = telemetry.StepReport(session_id="r-1", outcome="advanced", calls_asked=2)
    report.model_calls.append(telemetry.ModelCallRecord("m", 0, 1))
    assert report.summary() == "model turn: 2 tool calls"
    batch = telemetry.StepReport(session_id="r-1", outcome="finished", kind=telemetry.TOOL_BATCH, finish_reason="stop")
    batch.tool_calls.append(telemetry.ToolCallRecord("lookup", "c1", "ok", 0, 1))
    assert batch.summary() == "tool batch: 1 result; finished: stop"
    assert telemetry.StepReport(session_id="r", outcome="parked", error_code="LOUSHO_X").summary() == "parked: LOUSHO_X"
    assert (
        telemetry.StepReport(session_id="r", outcome="failed", error_code="LOUSHO_P", retry_in=2.5).summary()
        == "retry in 2.5 s: LOUSHO_P"
    )
    assert telemetry.StepReport(session_id="r", outcome="busy").summary().startswith("busy")


@pytest.fixture
def stepping(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``advance`` with ``run_step`` replaced: the test says what the step records and returns."""
    plan: dict[str, Any] = {}

    def run_step(_deps: Any, session_id: str, seq: int | None) -> Outcome:
        telemetry.note(**plan.get("notes", {}))
        outcome: Outcome = plan["outcome"]
        return outcome

    monkeypatch.setattr(tasks, "run_step", run_step)
    monkeypatch.setattr(tasks, "deps", lambda: None)
    return plan


def test_a_step_that_parks_its_run_fails_and_one_that_will_be_retried_is_retried(stepping: dict[str, Any]) -> None:
    stepping.update(outcome=Outcome.PARKED, notes={"error_code": "LOUSHO_HOOK_FAILED"})
    with pytest.raises(tasks.StepFailed, match="parked: LOUSHO_HOOK_FAILED"):
        tasks.advance.run(session_id="r-1", seq=2)
    assert tasks.StepFailed in tasks.advance.throws  # logged as expected, without a traceback
    stepping.update(outcome=Outcome.FAILED, notes={"error_code": "LOUSHO_PROVIDER_ERROR", "retry_in": 1.5})
    with pytest.raises(Retry) as retried:
        tasks.advance.run(session_id="r-1", seq=2)
    assert "retry in 1.5 s: LOUSHO_PROVIDER_ERROR" in str(retried.value)
    stepping.update(outcome=Outcome.ADVANCED, notes={"calls_asked": 0, "kind": telemetry.TOOL_BATCH})
    assert tasks.advance.run(session_id="r-1", seq=2) == "tool batch: 0 results"


def test_steps_are_sent_with_their_name_and_the_run_id_and_seq_as_keyword_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(tasks.advance, "apply_async", lambda **options: sent.append(options))
    tasks.enqueue("r-1", 4, 0.0, "support", name="support: tool batch")
    assert sent[0]["kwargs"] == {"session_id": "r-1", "seq": 4}
    assert sent[0]["shadow"] == "support: tool batch"
    assert "args" not in sent[0]


def test_the_sweeps_send_no_task_events_and_steps_do() -> None:
    assert tasks.recover.send_events is False
    assert tasks.fire_schedules.send_events is False
    assert tasks.advance.send_events is True


def test_json_log_lines_carry_the_step_fields_and_stay_masked() -> None:
    redaction.install()
    record_logger = logging.getLogger("lousho.test.json")
    formatter = logs.JsonFormatter()
    captured: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            captured.append(formatter.format(record))

    handler = Keep()
    record_logger.addHandler(handler)
    try:
        with telemetry.step("r-9", 7, task_id="t-1") as report:
            telemetry.note(
                agent="support", kind=telemetry.TOOL_BATCH, checkpoint=_checkpoint([Message(role="user", content="hi")])
            )
            record_logger.warning("calling with key sk-proj-abcdefghijklmnopqrstuvwxyz012345")
        assert report.agent == "support"
        record_logger.warning("outside a step")
    finally:
        record_logger.removeHandler(handler)
    inside, outside = (json.loads(line) for line in captured)
    assert {key: inside[key] for key in ("session_id", "agent", "seq", "kind", "task_id")} == {
        "session_id": "r-9",
        "agent": "support",
        "seq": 7,
        "kind": "tool batch",
        "task_id": "t-1",
    }
    assert inside["step"] == 0
    assert "abcdefghijklmnop" not in inside["message"]
    assert "session_id" not in outside and outside["message"] == "outside a step"
