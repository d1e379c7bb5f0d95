"""Where sub-agents meet delete, fork, resume and retention: a deleted lead starts no child, a delete takes the
children a concurrent step created, a child id that is not the lead's own is never adopted, a child whose lead is
gone stops before any model call, a fork never shares a child with its source, and a waiting run whose children
settled or went moves on ``resume()``. Real services, steps in-process."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, text

from producer.client import Client
from store import errors, records
from store.checkpoints import PostgresCheckpointStore
from store.records import Message
from tests.support import services
from tests.support.driver import Driver
from worker import Agent, ToolContext, subagents, tool
from worker.providers import MockModel
from worker.steps import Outcome

USAGE = {"input_tokens": 10, "output_tokens": 5}
#: Seconds a test waits for another connection to reach a lock before it fails.
LOCK_WAIT_S = 10.0


class Researcher:
    """The child agent, counting its model calls (a child that should not run must not call it)."""

    def __init__(self) -> None:
        self.calls = 0
        self.agent = Agent(name="researcher", model=MockModel(self._answer), tools=[])

    def _answer(self, messages: list[Message]) -> Any:
        self.calls += 1
        prompt = str(next(m.content for m in messages if m.role == "user"))
        return {"text": f"found: {prompt}", "usage": USAGE}


def _delegating(
    name: str,
    researcher: Researcher,
    *,
    background: bool = False,
    follow: tuple[str, ...] = (),
    tools: tuple[Any, ...] = (),
) -> Agent:
    """A lead whose first turn is one ``task`` call (with ``tools``' calls before it), then ``follow`` calls on
    the task's id (background only), then an answer quoting its last tool result."""

    def answer(messages: list[Message]) -> Any:
        turns = sum(1 for m in messages if m.role == "assistant")
        if turns == 0:
            first = [{"name": t.name, "args": {}} for t in tools]
            task = {"name": "task", "args": {"agent": "researcher", "prompt": "tides", "background": background}}
            return {"tool_calls": [*first, task], "usage": USAGE}
        if background and turns <= len(follow):
            task_id = json.loads(str(next(m.content for m in messages if m.role == "tool")))["task_id"]
            return {"tool_calls": [{"name": follow[turns - 1], "args": {"task_id": task_id}}], "usage": USAGE}
        return {"text": f"{name}: {str(messages[-1].content)[:60]}", "usage": USAGE}

    return Agent(
        name=name,
        model=MockModel(answer),
        tools=list(tools),
        subagents=[researcher.agent],
        background_on_finish="await",
    )


def _runs_under(engine: Engine, lead: str) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT session_id FROM runs WHERE starts_with(session_id, :p) ORDER BY 1"),
                {"p": lead + records.CHILD_MARK},
            ).scalars()
        )


def _tool_results(client: Client, agent: str, session_id: str) -> list[Message]:
    checkpoint = client.agent(agent).load(session_id)
    assert checkpoint is not None
    return [m for m in checkpoint.messages if m.role == "tool"]


# -- a deleted lead -------------------------------------------------------------------------------------------


def test_a_lead_deleted_while_its_tool_runs_starts_no_child(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore
) -> None:
    researcher = Researcher()

    @tool
    def slow(ctx: ToolContext) -> str:
        """A tool during which the run is deleted (from another process, in production)."""
        assert client.agent("lead").delete(ctx.session_id)
        return "slow done"

    driver = make_driver(_delegating("lead", researcher, tools=(slow,)), researcher.agent)
    client.agent("lead").send("research", session_id="seam-del")
    assert driver.step("seam-del") == Outcome.ADVANCED  # the model turn: slow, then task
    assert driver.step() == Outcome.FENCED  # the batch: the run went while slow ran
    driver.drain()

    assert _runs_under(store.engine, "seam-del") == []
    assert client.store.load("seam-del") is None and researcher.calls == 0


def test_a_delete_takes_the_children_a_step_started_while_it_waited_for_the_lead(
    store: PostgresCheckpointStore, client: Client
) -> None:
    store.append_input("seam-race", "lead", [Message(role="user", content="go")])
    child = "seam-race.task-00000000000000c1"
    deleted: list[bool] = []
    with store.engine.connect() as starting:
        # A step's start of a child, committed after the delete asked for the lead: it holds the lead as
        # ``start_children`` does, and its child row is not committed yet.
        starting.execute(text("SELECT 1 FROM runs WHERE session_id = 'seam-race' FOR KEY SHARE"))
        starting.execute(
            text(
                "INSERT INTO runs (session_id, agent, status, parent_id)"
                " VALUES (:sid, 'researcher', 'in-progress', 'seam-race')"
            ),
            {"sid": child},
        )
        deleting = threading.Thread(target=lambda: deleted.append(client.agent("lead").delete("seam-race")))
        deleting.start()
        services.wait_for_lock_waiter(store.engine, "the delete")
        starting.commit()
    deleting.join(timeout=LOCK_WAIT_S)

    assert deleted == [True]
    assert _runs_under(store.engine, "seam-race") == [] and store.load("seam-race") is None


def test_start_children_refuses_a_stale_fence_and_a_lead_that_is_gone(store: PostgresCheckpointStore) -> None:
    store.append_input("seam-fence", "lead", [Message(role="user", content="go")])
    claimed = store.claim("seam-fence", 7, None).checkpoint
    assert claimed is not None
    child = ("seam-fence.task-00000000000000f1", "researcher", "tides")

    with pytest.raises(errors.FencedOutError):
        store.start_children("seam-fence", "lead", [child], fence=6)  # a holder the claim of 7 replaced
    assert _runs_under(store.engine, "seam-fence") == []

    store.delete("seam-fence")
    with pytest.raises(errors.FencedOutError):
        store.start_children("seam-fence", "lead", [child], fence=7)
    assert _runs_under(store.engine, "seam-fence") == []


def test_a_child_id_that_is_not_the_leads_own_is_refused_not_adopted(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore
) -> None:
    researcher = Researcher()
    driver = make_driver(_delegating("lead", researcher), researcher.agent)
    taken = subagents.child_id("seam-taken", 1, "call_0_0")
    assert taken is not None
    # A run that took the id without being the lead's child (a fork or a start before ids were checked).
    client.store.append_input(taken, "researcher", [Message(role="user", content="someone else's")])

    client.agent("lead").send("research", session_id="seam-taken")
    driver.drain("seam-taken")

    (result,) = _tool_results(client, "lead", "seam-taken")
    assert result.is_error and json.loads(str(result.content))["error"] == "SubagentIdTaken"
    lead = client.agent("lead").load("seam-taken")
    assert lead is not None and lead.status == "finished" and not lead.delegated
    other = client.store.load(taken)
    assert other is not None and other.lead_agent is None and researcher.calls == 0  # left as it was
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT parent_id FROM runs WHERE session_id = :s"), {"s": taken}).scalar() is None


def test_a_child_whose_lead_is_gone_stops_before_any_model_call(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore
) -> None:
    researcher = Researcher()
    driver = make_driver(_delegating("lead", researcher), researcher.agent)
    client.agent("lead").send("research", session_id="seam-orphan")
    driver.step("seam-orphan")
    assert driver.step() == Outcome.DELEGATED
    (child,) = _runs_under(store.engine, "seam-orphan")
    # The lead's row alone goes (what a delete that missed a child, before this release, left behind).
    with store.engine.begin() as conn:
        conn.execute(text("DELETE FROM runs WHERE session_id = 'seam-orphan'"))
    driver.queue.clear()

    assert driver.step(child) == Outcome.PARKED

    assert researcher.calls == 0
    parked = client.store.load(child)
    assert parked is not None and parked.status != "finished"
    assert parked.last_error is not None and parked.last_error.code == "LOUSHO_LEAD_GONE"
    assert not parked.last_error.retryable
    driver.queue.clear()  # the wake-up of a lead that is gone
    assert driver.step(child) == Outcome.IDLE and researcher.calls == 0  # a later step leaves it


# -- forks and resume ------------------------------------------------------------------------------------------


def test_a_fork_of_a_waiting_lead_gets_a_child_of_its_own(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore
) -> None:
    researcher = Researcher()
    driver = make_driver(_delegating("lead", researcher), researcher.agent)
    lead = client.agent("lead")
    lead.send("research", session_id="seam-fork")
    driver.step("seam-fork")
    assert driver.step() == Outcome.DELEGATED
    (source_child,) = _runs_under(store.engine, "seam-fork")
    driver.queue.clear()  # the source's child has not run yet

    fork = lead.fork("seam-fork", from_step=1, new_session_id="seam-forked")
    assert [p.state for p in lead.pending() if p.session_id == "seam-forked"] == ["running"]
    run = lead.resume("seam-forked")
    assert run is not None
    driver.drain("seam-forked")

    own = _runs_under(store.engine, "seam-forked")
    assert len(own) == 1 and own[0] != source_child and records.lead_of(own[0]) == "seam-forked"
    result = run.wait(timeout=5)
    assert result.finish_reason == "stop" and str(result.text).startswith("lead: found: tides")
    # The fork's usage: its own two turns and its own child's one, each once.
    assert result.usage.input_tokens == 3 * 10
    untouched = client.store.load(source_child)
    assert untouched is not None and untouched.step == 0 and untouched.messages == []
    assert not fork.checkpoint.waiting and not fork.checkpoint.delegated and not fork.checkpoint.background


def test_a_forks_await_and_cancel_of_its_sources_task_find_no_task(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore
) -> None:
    researcher = Researcher()
    awaiting = _delegating("bg", researcher, background=True, follow=("agent_cancel", "agent_await"))
    driver = make_driver(awaiting, researcher.agent)
    bg = client.agent("bg")
    bg.send("go", session_id="seam-bg")
    driver.step("seam-bg")
    driver.step()  # the batch: the task's id at once
    source = bg.load("seam-bg")
    assert source is not None and source.background is not None
    (task_id,) = source.background
    driver.queue.clear()  # the source's task has not run yet

    fork = bg.fork("seam-bg", from_step=1, new_session_id="seam-bg-fork")
    bg.resume("seam-bg-fork")
    driver.drain("seam-bg-fork")

    _, *follow = _tool_results(client, "bg", "seam-bg-fork")
    assert [json.loads(str(m.content)).get("error") if m.is_error else m.content for m in follow] == [
        "TaskNotFound",
        "TaskNotFound",
    ]
    task = client.store.load(task_id)
    assert task is not None and not task.aborted and task.finish_reason is None
    assert client.store.progress(task_id) is not None
    with store.engine.connect() as conn:
        assert (
            conn.execute(text("SELECT abort_requested FROM runs WHERE session_id = :s"), {"s": task_id}).scalar()
            is None
        )
    assert not fork.checkpoint.background


def test_resume_moves_a_waiting_lead_whose_child_is_gone(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore
) -> None:
    researcher = Researcher()
    driver = make_driver(_delegating("lead", researcher), researcher.agent)
    lead = client.agent("lead")
    run = lead.send("research", session_id="seam-gone")
    driver.step("seam-gone")
    assert driver.step() == Outcome.DELEGATED
    (child,) = _runs_under(store.engine, "seam-gone")
    driver.queue.clear()
    assert client.agent("researcher").delete(child)  # nothing wakes the lead: it waits on a child that is gone

    assert lead.resume("seam-gone") is not None
    driver.drain("seam-gone")

    result = run.wait(timeout=5)
    assert result.finish_reason == "stop"
    (answer,) = _tool_results(client, "lead", "seam-gone")
    assert json.loads(str(answer.content))["error"] == "SubagentGone"


def test_resume_leaves_a_lead_whose_child_still_runs_waiting(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    researcher = Researcher()
    driver = make_driver(_delegating("lead", researcher), researcher.agent)
    lead = client.agent("lead")
    lead.send("research", session_id="seam-still")
    driver.step("seam-still")
    assert driver.step() == Outcome.DELEGATED
    driver.queue.clear()

    assert lead.resume("seam-still") is None


def test_a_fork_may_not_take_a_sub_agent_run_id(make_driver: Callable[..., Driver], client: Client) -> None:
    researcher = Researcher()
    driver = make_driver(_delegating("lead", researcher), researcher.agent)
    lead = client.agent("lead")
    lead.send("research", session_id="seam-id")
    driver.drain("seam-id")
    reserved = "someone.task-0123456789abcdef"

    with pytest.raises(errors.SessionIdInvalidError):
        lead.fork("seam-id", from_step=1, new_session_id=reserved)

    assert client.store.load(reserved) is None


# -- a child that settles while its lead steps ----------------------------------------------------------------


def _two_tasks(researcher: Researcher) -> Agent:
    """A lead whose first turn delegates two ``task`` calls, then answers with its tool results."""

    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {
                "tool_calls": [
                    {"name": "task", "args": {"agent": "researcher", "prompt": topic}} for topic in ("tides", "winds")
                ],
                "usage": USAGE,
            }
        return {"text": " | ".join(str(m.content)[:12] for m in messages if m.role == "tool"), "usage": USAGE}

    return Agent(name="lead", model=MockModel(answer), subagents=[researcher.agent])


def _meanwhile(action: Callable[[], None], what: str) -> None:
    """``action`` in another thread (another worker, a person) while this one waits inside a step; it must end."""
    other = threading.Thread(target=action)
    other.start()
    other.join(LOCK_WAIT_S)
    assert not other.is_alive(), f"{what} did not end"


def _settle_second_child_inside_the_leads_step(
    driver: Driver, store: PostgresCheckpointStore, monkeypatch: pytest.MonkeyPatch, lead: str
) -> list[Outcome]:
    """Run ``lead`` until its step woken by its first child reads the second one still running; at that moment
    the second child's step finishes it in another thread and delivers its wake-up, which meets the lead's lease.

    Returns the outcomes of the other thread's steps (the child's, then its wake-up's).
    """
    driver.step(lead)
    assert driver.step() == Outcome.DELEGATED
    (first, _), (second, _) = driver.queue
    driver.queue[:] = [(first, None)]
    assert driver.step() == Outcome.FINISHED  # the first child; its wake-up is queued
    assert driver.queue == [(lead, None)]
    real_load = store.load
    raced: list[Outcome] = []

    def load(session_id: str) -> records.Checkpoint | None:
        state = real_load(session_id)
        if session_id == second and not raced:

            def child_then_wake() -> None:
                driver.queue.insert(0, (second, None))
                raced.append(driver.step())  # the child finishes and queues its lead's wake-up
                raced.append(driver.step())  # that wake-up, while the lead's step holds the lease

            _meanwhile(child_then_wake, "the second child's step")
        return state

    monkeypatch.setattr(store, "load", load)
    assert driver.step() == Outcome.DELEGATED  # the lead read the second child before it finished
    monkeypatch.setattr(store, "load", real_load)
    assert raced == [Outcome.FINISHED, Outcome.BUSY]
    return raced


def test_a_child_that_settles_while_its_lead_steps_still_wakes_it(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    researcher = Researcher()
    driver = make_driver(_two_tasks(researcher), researcher.agent)
    run = client.agent("lead").send("research", session_id="seam-race")
    _settle_second_child_inside_the_leads_step(driver, store, monkeypatch, "seam-race")

    driver.drain()

    waiting = client.agent("lead").load("seam-race")
    assert waiting is not None and waiting.status == "finished", (
        f"the lead was left {waiting.status if waiting else None!r}, waiting={waiting.waiting if waiting else None},"
        f" with nothing queued to move it"
    )
    assert str(run.wait(timeout=5).text).count("found: ") == 2


def test_the_sweep_wakes_a_lead_whose_last_child_settled_before_the_leads_save(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    researcher = Researcher()
    driver = make_driver(_two_tasks(researcher), researcher.agent)
    run = client.agent("lead").send("research", session_id="seam-swept")
    _settle_second_child_inside_the_leads_step(driver, store, monkeypatch, "seam-swept")
    driver.queue.clear()  # whatever the step sent to wake the lead is lost

    assert [lead.session_id for lead in store.waiting_leads(0.0)] == ["seam-swept"]
    driver.drain("seam-swept")

    assert str(run.wait(timeout=5).text).count("found: ") == 2


# -- a decision while a step of the paused lead holds it --------------------------------------------------------


@tool(needs_approval=True)
def charge() -> str:
    """Charge the customer (a person approves it first)."""
    return "charged"


def test_a_decision_made_while_a_step_of_the_paused_lead_holds_it_still_moves_the_run(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a lead paused on an approval and waiting on a child, whose child settles and wakes it
    researcher = Researcher()
    driver = make_driver(_delegating("lead", researcher, tools=(charge,)), researcher.agent)
    run = client.agent("lead").send("charge and research", session_id="seam-decide")
    driver.step("seam-decide")
    assert driver.step() == Outcome.PAUSED
    assert driver.step() == Outcome.FINISHED
    real_decisions = store.decisions
    raced: list[Outcome] = []

    def decisions(approval_ids: Any) -> dict[str, records.Approval]:
        found = real_decisions(approval_ids)
        if approval_ids and not raced:  # the lead's step read the approval undecided; a person decides it now
            (pending,) = client.agent("lead").approvals.list()

            def decide_and_deliver() -> None:
                client.agent("lead").approvals.resolve(pending.approval_id, approved=True)
                driver.queue.insert(0, ("seam-decide", None))  # the decision's step, while the lead's step holds it
                raced.append(driver.step())

            _meanwhile(decide_and_deliver, "the decision")
        return found

    # When the lead's step (woken by its child) saves it paused from what it read before the decision
    monkeypatch.setattr(store, "decisions", decisions)
    driver.step()
    monkeypatch.setattr(store, "decisions", real_decisions)
    assert raced == [Outcome.BUSY]

    # Then the decision stands and the run goes on to its answer
    driver.drain()
    done = client.agent("lead").load("seam-decide")
    assert done is not None and done.status == "finished", f"the lead was left {done.status if done else None!r}"
    assert "found: " in str(run.wait(timeout=5).text)
