"""``ask_question`` decisions on the memory runtime: a question is answered or declined, never both."""

from __future__ import annotations

import json
from typing import Any

import pytest

from store import errors, inputs
from store.memory import MemoryApprovalStore
from store.records import Message
from tests.fakes.runtime import MemoryRuntime
from worker import Agent
from worker.providers import MockModel


def _asker(seen: list[list[Any]]) -> Agent:
    def model(messages: list[Message]) -> Any:
        if not any(m.role == "assistant" for m in messages):
            return {"tool_calls": [{"name": "ask_question", "args": {"question": "Which city?"}}]}
        seen.append([m.content for m in messages if m.role == "tool"])
        return "planned"

    return Agent(name="asker", model=MockModel(model), ask_question=True)


@pytest.mark.parametrize(
    ("kind", "approved", "answer", "decided"),
    [
        ("question", None, "Oslo", ("approved", "Oslo")),
        ("question", True, "Oslo", ("approved", "Oslo")),
        ("question", False, None, ("rejected", None)),
        ("tool", True, None, ("approved", None)),
        ("tool", False, None, ("rejected", None)),
    ],
)
def test_a_decision_that_fits_its_kind_is_recorded(
    kind: str, approved: bool | None, answer: str | None, decided: tuple[str, str | None]
) -> None:
    assert inputs.decision_status(kind, approved, answer) == decided


@pytest.mark.parametrize(
    ("kind", "approved", "answer"),
    [
        ("question", False, "Oslo"),  # declined, yet answered
        ("question", True, None),  # approved, with nothing to say
        ("question", None, None),
        ("tool", True, "Oslo"),
        ("tool", None, None),
    ],
)
def test_a_decision_that_does_not_fit_its_kind_is_refused(kind: str, approved: bool | None, answer: str | None) -> None:
    with pytest.raises(errors.ConfigurationError):
        inputs.decision_status(kind, approved, answer)


def test_a_declined_question_carries_no_answer_to_the_model() -> None:
    seen: list[list[Any]] = []
    runtime = MemoryRuntime.build([_asker(seen)])
    approvals = MemoryApprovalStore(runtime.store)
    runtime.send("q-1", "asker", "plan a trip")
    runtime.drain()
    (question,) = approvals.pending(None)
    # A decline that carries an answer is refused, and the question still waits.
    with pytest.raises(errors.ConfigurationError, match="declined question takes no answer"):
        approvals.resolve(question.approval_id, approved=False, note="not telling", answer="Oslo")
    assert [a.approval_id for a in approvals.pending(None)] == [question.approval_id]
    decided = approvals.resolve(question.approval_id, approved=False, note="not telling")
    assert (decided.approval.status, decided.approval.answer) == ("rejected", None) and decided.run_continues
    runtime.queue("q-1", None)  # what the producer publishes after the last decision
    runtime.drain()
    (result,) = seen[0]
    body = json.loads(result)
    assert (body["kind"], body["error"], body["note"]) == ("declined", "QuestionDeclined", "not telling")
    assert "Oslo" not in result and runtime.checkpoint("q-1").finish_reason == "stop"
