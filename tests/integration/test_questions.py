"""``ask_question``: a run asks a person, waits (a worker restart in between), and goes on with the answer."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from producer.client import Client
from store import errors
from store.records import Message
from store.settings import Settings
from tests.support.driver import Driver
from worker import Agent, tool
from worker.providers import MockModel

ran: list[str] = []


@tool
def lookup(city: str) -> str:
    """Look up a city."""
    ran.append(city)
    return f"{city}: sunny"


def _planner(seen: list[list[Any]]) -> Agent:
    def model(messages: list[Message]) -> Any:
        turns = sum(1 for m in messages if m.role == "assistant")
        if turns == 0:
            return {
                "tool_calls": [
                    {"name": "ask_question", "args": {"question": "Which city?", "options": ["Oslo", "Rome"]}},
                    {"name": "lookup", "args": {"city": "Bergen"}},
                ]
            }
        seen.append([m.content for m in messages if m.role == "tool"])
        return "planned"

    return Agent(name="planner", model=MockModel(model), tools=[lookup], ask_question=True)


def _paused(make_driver: Callable[..., Driver], client: Client, seen: list[list[Any]]) -> str:
    ran.clear()
    driver = make_driver(_planner(seen))
    run = client.agent("planner").send("plan a trip", session_id="q-1")
    driver.drain("q-1")
    assert run.wait(timeout=5).finish_reason == "awaiting-approval"
    assert ran == ["Bergen"]  # the other call of the turn ran
    return run.session_id


def test_a_question_answered_from_another_process_after_a_worker_restart(
    make_driver: Callable[..., Driver], client: Client, settings: Settings
) -> None:
    seen: list[list[Any]] = []
    _paused(make_driver, client, seen)
    [question] = client.approvals.list()
    assert (question.kind, question.question, question.options, question.tool_name) == (
        "question",
        "Which city?",
        ["Oslo", "Rome"],
        "ask_question",
    )
    assert [(p.state, p.approval_kind) for p in client.agent("planner").pending()] == [
        ("awaiting-approval", "question")
    ]
    requested = [e for e in client.read_events("q-1", -1) if e.type == "approval.requested"]
    assert requested[0].data["kind"] == "question" and requested[0].data["question"] == "Which city?"

    restarted = make_driver(_planner(seen))  # a new worker; the old one is gone
    with Client(settings) as elsewhere:  # another process's client
        run = elsewhere.approvals.resolve(question.approval_id, answer="Oslo", note="my favourite")
        restarted.drain("q-1")
        assert run.wait(timeout=5).finish_reason == "stop"
    assert json.loads(seen[-1][0]) == {"answer": "Oslo"}
    assert ran == ["Bergen"]  # nothing ran twice
    decided = client.approvals._store.by_ids([question.approval_id])[question.approval_id]
    assert (decided.status, decided.answer) == ("approved", "Oslo")


def test_a_declined_question_gives_the_model_a_declined_result(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    seen: list[list[Any]] = []
    _paused(make_driver, client, seen)
    [question] = client.approvals.list()
    run = client.approvals.resolve(question.approval_id, approved=False, note="ask me tomorrow")
    make_driver(_planner(seen)).drain("q-1")
    assert run.wait(timeout=5).finish_reason == "stop"
    body = json.loads(seen[-1][0])
    assert (body["kind"], body["note"]) == ("declined", "ask me tomorrow")


def test_decisions_that_do_not_fit_the_kind_are_refused_and_leave_it_pending(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    seen: list[list[Any]] = []
    _paused(make_driver, client, seen)
    [question] = client.approvals.list()
    with pytest.raises(errors.ConfigurationError):
        client.approvals.resolve(question.approval_id, approved=True)  # a question needs an answer
    with pytest.raises(errors.ConfigurationError):
        client.approvals.resolve(question.approval_id)
    assert [a.approval_id for a in client.approvals.list()] == [question.approval_id]


def test_an_answer_is_refused_for_a_tool_approval(make_driver: Callable[..., Driver], client: Client) -> None:
    @tool(needs_approval=True)
    def pay(amount: int) -> str:
        """Pay."""
        return f"paid {amount}"

    driver = make_driver(
        Agent(
            name="payer", model=MockModel([{"tool_calls": [{"name": "pay", "args": {"amount": 3}}]}, "ok"]), tools=[pay]
        )
    )
    client.agent("payer").send("pay", session_id="q-2", check_agent=False)
    driver.drain("q-2")
    [approval] = client.approvals.list()
    assert approval.kind == "tool" and approval.question is None
    with pytest.raises(errors.ConfigurationError):
        client.approvals.resolve(approval.approval_id, answer="yes")
    assert [a.approval_id for a in client.approvals.list()] == [approval.approval_id]
