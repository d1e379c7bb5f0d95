"""Sub-agents as child runs: a lead's ``task`` calls start children that run as runs of their own, the lead waits
without a step due, and the last child to settle wakes it; results carry the child's text and footer, usage folds
into the lead's, a parked child is an error result, depth is limited, and abort and delete reach the children.
Real services, steps in-process."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from producer.client import Client
from store import errors, records
from store.records import Message
from tests.support.driver import Driver, postgres
from worker import Agent, HookContext, PropagatingToolError, tool
from worker.providers import MockModel
from worker.steps import Outcome

USAGE = {"input_tokens": 10, "output_tokens": 5}


@tool
def look(topic: str) -> str:
    """Look a topic up."""
    if topic == "broken":
        raise PropagatingToolError("the archive is down")
    return f"notes on {topic}"


def _researcher() -> Agent:
    def answer(messages: list[Message]) -> Any:
        prompt = str(next(m.content for m in messages if m.role == "user"))
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "look", "args": {"topic": prompt}}], "usage": USAGE}
        return {"text": f"found: {messages[-1].content}", "usage": USAGE}

    return Agent(name="researcher", model=MockModel(answer), tools=[look])


def _lead(*children: Agent, depth: int = 1) -> Agent:
    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {
                "tool_calls": [
                    {"name": "task", "args": {"agent": "researcher", "prompt": "tides", "description": "tides"}},
                    {"name": "task", "args": {"agent": "researcher", "prompt": "winds"}},
                    {"name": "look", "args": {"topic": "maps"}},
                ],
                "usage": USAGE,
            }
        return {
            "text": "report: " + " | ".join(str(m.content)[:20] for m in messages if m.role == "tool"),
            "usage": USAGE,
        }

    return Agent(name="lead", model=MockModel(answer), tools=[look], subagents=list(children), max_subagent_depth=depth)


def test_parallel_children_run_as_their_own_runs_and_the_last_one_wakes_the_lead(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    researcher = _researcher()
    driver = make_driver(_lead(researcher), researcher)
    run = client.agent("lead").send("research", session_id="sub-1")
    assert driver.step("sub-1") == Outcome.ADVANCED  # the model turn
    assert driver.step() == Outcome.DELEGATED  # the batch: look ran, two children started
    lead = client.agent("lead").load("sub-1")
    assert lead is not None and lead.waiting and lead.delegated is not None and len(lead.delegated) == 2
    children = sorted(lead.delegated.values())
    assert all(records.lead_of(child) == "sub-1" for child in children)
    assert "sub-1" not in [d.session_id for d in postgres(client.store).due_runs(0.0)]  # no step due while it waits
    assert [p.session_id for p in client.agent("lead").pending()] == ["sub-1"]
    driver.drain()
    result = run.wait(timeout=5)
    assert result.finish_reason == "stop"
    first, second, maps = [m for m in client.agent("lead").load("sub-1").messages if m.role == "tool"]  # type: ignore[union-attr]
    assert str(first.content).startswith("found: notes on tides") and "[sub-agent 'researcher': 2 step(s)" in str(
        first.content
    )
    assert str(second.content).startswith("found: notes on winds") and maps.content == "notes on maps"
    # Usage: the lead's two turns and each child's two.
    assert result.usage.input_tokens == 2 * 10 + 2 * 2 * 10
    types = [e.type for e in client.read_events("sub-1", -1)]
    assert types.count("subagent.start") == 2 and types.count("subagent.done") == 2
    for child in children:
        assert client.agent("researcher").load(child).final_text.startswith("found")  # type: ignore[union-attr]


def test_a_parked_child_gives_its_call_an_error_result(make_driver: Callable[..., Driver], client: Client) -> None:
    researcher = _researcher()

    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "task", "args": {"agent": "researcher", "prompt": "broken"}}]}
        return "lead done"

    lead = Agent(name="lead2", model=MockModel(answer), subagents=[researcher])
    driver = make_driver(lead, researcher)
    run = client.agent("lead2").send("go", session_id="sub-2")
    driver.drain("sub-2")
    assert run.wait(timeout=5).text == "lead done"
    (result,) = [m for m in client.agent("lead2").load("sub-2").messages if m.role == "tool"]  # type: ignore[union-attr]
    body = json.loads(str(result.content))
    assert result.is_error and body["error"] == "SubagentParked" and "LOUSHO_TOOL_PROPAGATED" in body["message"]


def test_depth_is_limited_and_child_ids_are_not_for_senders(make_driver: Callable[..., Driver], client: Client) -> None:
    inner = _researcher()

    def middle_answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "task", "args": {"agent": "researcher", "prompt": "deep"}}]}
        return f"middle: {messages[-1].content}"

    middle = Agent(name="middle", model=MockModel(middle_answer), subagents=[inner])

    def top_answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "task", "args": {"agent": "middle", "prompt": "dig"}}]}
        return f"top: {messages[-1].content}"

    top = Agent(name="top", model=MockModel(top_answer), subagents=[middle])
    driver = make_driver(top, middle, inner)
    run = client.agent("top").send("go", session_id="sub-3")
    driver.drain("sub-3")
    text = run.wait(timeout=5).text
    assert text is not None and "SubagentDepthExceeded" in text  # the middle child may not start its own
    with pytest.raises(errors.SessionIdInvalidError):
        client.agent("top").send("hi", session_id="sub-3.task-0123456789abcdef")


def test_aborting_the_lead_aborts_its_children_and_deleting_it_deletes_them(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    researcher = _researcher()
    driver = make_driver(_lead(researcher), researcher)
    client.agent("lead").send("research", session_id="sub-4")
    driver.step("sub-4")
    driver.step()
    children = sorted((client.agent("lead").load("sub-4").delegated or {}).values())  # type: ignore[union-attr]
    driver.queue.clear()  # the children's first steps are lost: only the abort moves anything now
    client.agent("lead").abort("sub-4")
    for run_id in ["sub-4", *children]:
        driver.drain(run_id)
    lead = client.agent("lead").load("sub-4")
    assert lead is not None and lead.finish_reason == "aborted" and not lead.waiting
    assert all(client.agent("researcher").load(c).finish_reason == "aborted" for c in children)  # type: ignore[union-attr]
    assert client.agent("lead").delete("sub-4")
    assert all(client.agent("researcher").load(c) is None for c in children)


def test_an_approval_inside_a_child_pauses_the_lead_and_its_decision_finishes_both(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    ran: list[str] = []

    @tool(needs_approval=True)
    def publish(topic: str) -> str:
        """Publish findings (a person approves)."""
        ran.append(topic)
        return f"published {topic}"

    def writer_answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "publish", "args": {"topic": "tides"}}]}
        return f"writer: {messages[-1].content}"

    writer = Agent(name="writer", model=MockModel(writer_answer), tools=[publish])

    def lead_answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "task", "args": {"agent": "writer", "prompt": "write it up"}}]}
        return f"lead: {str(messages[-1].content)[:30]}"

    lead = Agent(name="editor", model=MockModel(lead_answer), subagents=[writer])
    driver = make_driver(lead, writer)
    run = client.agent("editor").send("go", session_id="sub-5")
    driver.drain("sub-5")
    paused = run.wait(timeout=5)
    assert paused.finish_reason == "awaiting-approval"
    (approval,) = client.approvals.list()
    assert paused.approval_ids == [approval.approval_id]
    assert approval.run_path[0] == "sub-5" and len(approval.run_path) == 2 and approval.agent == "writer"
    assert [(p.session_id, p.state, p.lead) for p in client.pending()] == [
        ("sub-5", "waiting", None),
        (approval.session_id, "awaiting-approval", "sub-5"),
    ]
    with pytest.raises(errors.SessionAwaitingApprovalError):
        client.agent("editor").send("more", session_id="sub-5")
    client.approvals.resolve(approval.approval_id, approved=True)
    driver.drain(approval.session_id)  # the child's step; its end wakes the lead
    finished = client.agent("editor").load("sub-5")
    assert finished is not None and finished.status == "finished" and ran == ["tides"]
    assert str(finished.final_text).startswith("lead: writer: published tides")


def test_a_child_runs_its_leads_hooks(make_driver: Callable[..., Driver], client: Client) -> None:
    seen: list[tuple[str, str | None]] = []

    class Audit:
        def pre_tool_call(self, ctx: HookContext) -> None:
            seen.append((ctx.agent, ctx.tool_name))

    researcher = _researcher()

    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "task", "args": {"agent": "researcher", "prompt": "reefs"}}]}
        return "done"

    lead = Agent(name="audited-lead", model=MockModel(answer), subagents=[researcher], hooks=[Audit()])
    driver = make_driver(lead, researcher)
    client.agent("audited-lead").send("go", session_id="sub-6")
    driver.drain("sub-6")
    assert seen == [("audited-lead", "task"), ("researcher", "look")]


def test_the_leads_events_include_its_childrens_tagged_in_time_order(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    researcher = _researcher()
    driver = make_driver(_lead(researcher), researcher)
    client.agent("lead").send("research", session_id="sub-7")
    driver.drain("sub-7")
    events = list(client.agent("lead").events("sub-7", -1, include_children=True, timeout=10))
    assert events[-1].run_id == "sub-7" and events[-1].type == "run.done"
    children = {e.run_id for e in events if e.run_id != "sub-7"}
    assert len(children) == 2 and all(records.lead_of(c) == "sub-7" for c in children)
    tags = {e.run_id: e.data["subagent"] for e in events if e.run_id != "sub-7"}
    assert {t["name"] for t in tags.values()} == {"researcher"}
    assert {(t["depth"], t["parent"]) for t in tags.values()} == {(1, "sub-7")}
    assert [e.at for e in events] == sorted(e.at for e in events)
    for child in children:  # each child's events keep their own numbering
        seqs = [e.seq for e in events if e.run_id == child and e.seq is not None]
        assert seqs == sorted(seqs) and seqs[0] == 0
    lead_only = [e for e in client.agent("lead").events("sub-7", -1, timeout=10)]
    assert {e.run_id for e in lead_only} == {"sub-7"}


def test_a_turn_with_a_gated_call_and_a_task_waits_for_both_and_asks_the_person_once(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    ran: list[str] = []

    @tool(needs_approval=True)
    def send_report(to: str) -> str:
        """Send the report (a person approves)."""
        ran.append(to)
        return f"sent to {to}"

    researcher = _researcher()

    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {
                "tool_calls": [
                    {"name": "task", "args": {"agent": "researcher", "prompt": "reefs"}},
                    {"name": "send_report", "args": {"to": "board"}},
                ]
            }
        return "all done"

    lead = Agent(name="mixed", model=MockModel(answer), tools=[send_report], subagents=[researcher])
    driver = make_driver(lead, researcher)
    run = client.agent("mixed").send("go", session_id="sub-8")
    driver.drain("sub-8")  # the child runs and wakes the lead, still paused on the person
    (approval,) = client.approvals.list()
    assert approval.session_id == "sub-8"
    paused = client.agent("mixed").load("sub-8")
    assert paused is not None and paused.status == "awaiting-approval" and paused.approval_ids == [approval.approval_id]
    assert [m.name for m in paused.messages if m.role == "tool"] == ["task"]  # the child's result is in
    client.approvals.resolve(approval.approval_id, approved=True)
    driver.drain("sub-8")
    assert run.wait(timeout=5).text == "all done" and ran == ["board"]
    assert len(client.approvals.list()) == 0


def test_at_most_tool_concurrency_children_run_at_once(make_driver: Callable[..., Driver], client: Client) -> None:
    researcher = _researcher()

    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {
                "tool_calls": [{"name": "task", "args": {"agent": "researcher", "prompt": f"t{k}"}} for k in range(5)]
            }
        return "five done"

    lead = Agent(name="capped", model=MockModel(answer), subagents=[researcher], tool_concurrency=2)
    driver = make_driver(lead, researcher)
    run = client.agent("capped").send("go", session_id="sub-9")
    driver.step("sub-9")
    driver.step()
    first = client.agent("capped").load("sub-9")
    assert first is not None and len(first.delegated or {}) == 2  # two started, three wait for a place
    most = 0
    while driver.queue:
        driver.step()
        state = client.agent("capped").load("sub-9")
        running = [
            c
            for c in (state.delegated or {}).values()  # type: ignore[union-attr]
            if client.agent("researcher").load(c).status != "finished"  # type: ignore[union-attr]
        ]
        most = max(most, len(running))
    assert most <= 2
    assert run.wait(timeout=5).text == "five done"
    results = [m for m in client.agent("capped").load("sub-9").messages if m.role == "tool"]  # type: ignore[union-attr]
    assert [str(m.content).split("[")[0].strip() for m in results] == [f"found: notes on t{k}" for k in range(5)]


def _background_lead(name: str, on_finish: str, follow: list[dict[str, Any]]) -> Agent:
    """A lead that starts a background task, then runs ``follow`` (calls given the task id), then answers."""

    def answer(messages: list[Message]) -> Any:
        turns = sum(1 for m in messages if m.role == "assistant")
        if turns == 0:
            return {
                "tool_calls": [
                    {"name": "task", "args": {"agent": "researcher", "prompt": "slow seas", "background": True}}
                ]
            }
        task_id = json.loads(str(next(m.content for m in messages if m.role == "tool")))["task_id"]
        if turns <= len(follow):
            call = follow[turns - 1]
            return {"tool_calls": [{"name": call["name"], "args": {"task_id": task_id}}]}
        return f"{name} answered"

    return Agent(name=name, model=MockModel(answer), subagents=[_researcher()], background_on_finish=on_finish)  # type: ignore[arg-type]


def test_a_background_task_returns_at_once_and_is_followed_by_status_and_await(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    lead = _background_lead("bg", "cancel", [{"name": "agent_status"}, {"name": "agent_await"}])
    driver = make_driver(lead, lead.subagents["researcher"])
    run = client.agent("bg").send("go", session_id="sub-10")
    driver.step("sub-10")
    driver.step()  # the batch: the task's id at once, and the child sent a step
    started = client.agent("bg").load("sub-10")
    assert started is not None and not started.waiting and started.background and len(started.background) == 1
    child = started.background[0]
    driver.queue.sort(key=lambda message: message[0] != "sub-10")  # the lead goes on before the child
    driver.step()  # model: agent_status
    driver.step()  # batch: status
    status = json.loads(str([m for m in client.agent("bg").load("sub-10").messages if m.role == "tool"][-1].content))  # type: ignore[union-attr]
    assert status["task_id"] == child and status["status"] == "running"
    driver.drain()
    assert run.wait(timeout=5).text == "bg answered"
    awaited = [m for m in client.agent("bg").load("sub-10").messages if m.role == "tool"][-1]  # type: ignore[union-attr]
    assert str(awaited.content).startswith("found: notes on slow seas")


def test_background_tasks_still_running_at_the_answer_are_cancelled_or_awaited(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    cancelling = _background_lead("bg-cancel", "cancel", [])
    awaiting = _background_lead("bg-await", "await", [])
    driver = make_driver(cancelling, awaiting, cancelling.subagents["researcher"])
    for lead, sid in ((cancelling, "sub-11"), (awaiting, "sub-12")):
        client.agent(lead.name).send("go", session_id=sid)
        driver.step(sid)
        driver.step()
        children = [m for m in driver.queue if m[0] != sid]
        driver.queue[:] = [m for m in driver.queue if m[0] == sid]  # hold the child's first step back
        driver.drain()
        assert client.agent(lead.name).load(sid).final_text == f"{lead.name} answered"  # type: ignore[union-attr]
        driver.queue.extend(children)
        driver.drain()
    cancelled_child = client.agent("bg-cancel").load("sub-11").background[0]  # type: ignore[union-attr, index]
    assert client.agent("bg-cancel").load("sub-11").status == "finished"  # type: ignore[union-attr]
    assert client.agent("researcher").load(cancelled_child).finish_reason == "aborted"  # type: ignore[union-attr]
    awaited = client.agent("bg-await").load("sub-12")
    assert awaited is not None and awaited.status == "finished" and not awaited.waiting
    awaited_child = (awaited.background or [])[0]
    assert client.agent("researcher").load(awaited_child).finish_reason == "stop"  # type: ignore[union-attr]


def test_the_leads_limits_count_what_a_running_background_task_spent(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    from store.limits import Limits

    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {
                "tool_calls": [
                    {"name": "task", "args": {"agent": "researcher", "prompt": "far seas", "background": True}}
                ],
                "usage": {"input_tokens": 1},
            }
        return {"text": "lead answered", "usage": {"input_tokens": 1}}

    researcher = _researcher()
    lead = Agent(name="bg-budget", model=MockModel(answer), subagents=[researcher], limits=Limits(max_input_tokens=10))
    driver = make_driver(lead, researcher)
    client.agent("bg-budget").send("go", session_id="sub-13")
    driver.step("sub-13")  # the lead's turn: 1 input token
    driver.step()  # its batch: the task starts in the background
    driver.queue.sort(key=lambda message: message[0] == "sub-13")  # the child's model turn first: 10 tokens
    driver.step()
    driver.step()  # the lead's next model call: 1 + 10 in flight reaches the limit of 10
    stopped = client.agent("bg-budget").load("sub-13")
    assert stopped is not None and stopped.finish_reason == "budget-exceeded" and stopped.usage.input_tokens == 1


def test_a_childs_drift_is_judged_under_its_leads_policy(make_driver: Callable[..., Driver], client: Client) -> None:
    def child_answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "look", "args": {"topic": "drift"}}]}
        return "child done"

    child_v1 = Agent(name="drifter", model=MockModel(child_answer, model_id="v1"), tools=[look])
    child_v2 = Agent(name="drifter", model=MockModel(child_answer, model_id="v2"), tools=[look])  # warn by default

    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "task", "args": {"agent": "drifter", "prompt": "p"}}]}
        return "lead done"

    strict = Agent(name="strict-lead", model=MockModel(answer), subagents=[child_v1], on_agent_drift="error")
    before = make_driver(strict, child_v1)
    client.agent("strict-lead").send("go", session_id="sub-14")
    before.step("sub-14")
    before.step()
    (child,) = (client.agent("strict-lead").load("sub-14").delegated or {}).values()  # type: ignore[union-attr]
    before.queue.clear()
    before.step(child)  # the child's model turn, saved by v1
    after = make_driver(
        Agent(name="strict-lead", model=MockModel(answer), subagents=[child_v2], on_agent_drift="error"), child_v2
    )
    after.drain(child)
    stored = client.agent("drifter").load(child)
    assert stored is not None and stored.last_error is not None and stored.last_error.code == "LOUSHO_AGENT_DRIFT"


def test_a_childs_drift_refusal_keeps_its_lead_waiting_until_the_child_is_resumed(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    def child_answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "look", "args": {"topic": "drift"}}]}
        return "child done"

    child_v1 = Agent(name="drifter", model=MockModel(child_answer, model_id="v1"), tools=[look])
    child_v2 = Agent(name="drifter", model=MockModel(child_answer, model_id="v2"), tools=[look])

    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "task", "args": {"agent": "drifter", "prompt": "p"}}]}
        return "lead done: " + str(messages[-1].content)[:10]

    def lead(child: Agent) -> Agent:
        return Agent(name="strict-lead", model=MockModel(answer), subagents=[child], on_agent_drift="error")

    # Given a child whose model turn was saved by v1, then refused by a v2 worker (the lead's policy is "error")
    before = make_driver(lead(child_v1), child_v1)
    run = client.agent("strict-lead").send("go", session_id="sub-15")
    before.step("sub-15")
    before.step()
    (child,) = (client.agent("strict-lead").load("sub-15").delegated or {}).values()  # type: ignore[union-attr]
    before.queue.clear()
    before.step(child)
    after = make_driver(lead(child_v2), child_v2)
    after.drain(child)
    after.drain("sub-15")
    # Then the lead still waits on the child: its call has no result and nothing of its turn moved on
    waiting = client.agent("strict-lead").load("sub-15")
    assert waiting is not None and waiting.waiting and waiting.status == "in-progress", waiting
    assert not [m for m in waiting.messages if m.role == "tool"]
    assert [p.session_id for p in client.agent("strict-lead").pending()] == ["sub-15"]
    # And the sweep does not keep waking it while the child waits for a person
    assert "sub-15" not in [d.session_id for d in postgres(client.store).waiting_leads(0.0)]
    # When the child is fixed (v1 again) and resumed, it finishes and the lead gets its text
    fixed = make_driver(lead(child_v1), child_v1)
    assert client.agent("drifter").resume(child) is not None
    fixed.drain(child)
    fixed.drain("sub-15")
    assert run.wait(timeout=5).text == "lead done: child done"


def test_a_question_inside_a_child_pauses_the_lead_and_its_answer_finishes_both(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    def asker_answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "ask_question", "args": {"question": "Which sea?"}}]}
        return f"asker: {messages[-1].content}"

    asker = Agent(name="asker-child", model=MockModel(asker_answer), ask_question=True)

    def lead_answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "task", "args": {"agent": "asker-child", "prompt": "find out"}}]}
        return f"lead: {str(messages[-1].content).split(chr(10))[0]}"

    lead = Agent(name="asking-lead", model=MockModel(lead_answer), subagents=[asker])
    driver = make_driver(lead, asker)
    run = client.agent("asking-lead").send("go", session_id="sub-15")
    driver.drain("sub-15")
    assert run.wait(timeout=5).finish_reason == "awaiting-approval"
    (question,) = client.approvals.list()
    assert question.kind == "question" and question.run_path[0] == "sub-15"
    client.approvals.resolve(question.approval_id, answer="the Baltic")
    driver.drain(question.session_id)
    assert client.agent("asking-lead").load("sub-15").final_text == 'lead: asker: {"answer":"the Baltic"}'  # type: ignore[union-attr]


def test_a_childs_spend_counts_against_its_leads_limits(make_driver: Callable[..., Driver], client: Client) -> None:
    from store.limits import Limits

    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {
                "tool_calls": [{"name": "task", "args": {"agent": "researcher", "prompt": "capes"}}],
                "usage": {"input_tokens": 1},
            }
        return {"text": "lead answered", "usage": {"input_tokens": 1}}

    researcher = _researcher()  # two turns of 10 input tokens
    lead = Agent(
        name="metered-lead", model=MockModel(answer), subagents=[researcher], limits=Limits(max_input_tokens=15)
    )
    driver = make_driver(lead, researcher)
    run = client.agent("metered-lead").send("go", session_id="sub-16")
    driver.drain("sub-16")
    stopped = run.wait(timeout=5)
    assert stopped.finish_reason == "budget-exceeded" and stopped.usage.input_tokens == 1 + 20
