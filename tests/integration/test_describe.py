"""The operator's view on the real services: ``Client.runs`` pages every run in its state, ``Client.describe`` says
what each waits on and what moves it next (a test per state), ``Client.run`` waits on a run started anywhere and
``Client.delete`` drops one without naming its agent. Steps run in-process; step messages go to the real broker."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import redis
from sqlalchemy import text

from producer.client import Client
from store import errors, summaries
from store.checkpoints import PostgresCheckpointStore
from store.leases import LeaseManager
from store.limits import Limits, Prices
from store.model_slots import RedisModelSlots
from store.records import LastError, Message, Usage
from store.registry import PostgresAgentRegistry
from tests.support.driver import Driver
from worker import Agent, ModelLimit, tool
from worker.providers import MockModel
from worker.steps import Outcome

pytestmark = pytest.mark.integration

USAGE = {"input_tokens": 10, "output_tokens": 40}


@tool(needs_approval=True)
def refund(amount: int) -> str:
    """Refund the customer."""
    return f"refunded {amount}"


@tool
def note(text: str) -> str:
    """Write a note."""
    return f"noted {text}"


def _desk() -> Agent:
    return Agent(
        name="desk",
        model=MockModel([{"tool_calls": [{"name": "refund", "args": {"amount": 5}}]}, "Refunded."]),
        tools=[refund],
    )


def _plain() -> Agent:
    return Agent(name="plain", model=MockModel([{"text": "Hello.", "usage": USAGE}]))


def _metered() -> Agent:
    script: list[object] = [
        {"tool_calls": [{"name": "note", "args": {"text": str(n)}}], "usage": USAGE} for n in range(5)
    ]
    return Agent(name="metered", model=MockModel([*script, "done"]), tools=[note], limits=Limits(max_output_tokens=50))


def _lead(child: Agent) -> Agent:
    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "task", "args": {"agent": child.name, "prompt": "check it"}}]}
        return "lead done"

    return Agent(name="lead", model=MockModel(answer), subagents=[child])


def _served(store: PostgresCheckpointStore, *agents: Agent) -> None:
    """A live worker serves these agents (as a started worker registers them)."""
    PostgresAgentRegistry(store.engine).register("host:1", {a.name: a.fingerprint() for a in agents}, [1, 2, 3])


def _backdate(store: PostgresCheckpointStore, session_id: str, seconds: float) -> None:
    """Make everything the run did look ``seconds`` older (its save, its input, the sweep's last send)."""
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE runs SET updated_at = updated_at - make_interval(secs => :s),"
                " created_at = created_at - make_interval(secs => :s), swept_at = NULL"
                " WHERE session_id = :sid"
            ),
            {"s": seconds, "sid": session_id},
        )
        conn.execute(
            text("UPDATE inbox SET created_at = created_at - make_interval(secs => :s) WHERE session_id = :sid"),
            {"s": seconds, "sid": session_id},
        )


def _drop_messages(redis_client: redis.Redis) -> None:
    """Empty the broker's queues (the step messages the producer sent)."""
    for key in redis_client.scan_iter("lousho*"):
        if redis_client.type(key) == b"list":
            redis_client.delete(key)


class _Described(summaries.RunSummary):
    """What ``describe`` always fills in (the listing leaves these None)."""

    waiting_on: summaries.WaitingOn
    next_action: str


def _describe(client: Client, session_id: str) -> _Described:
    found = client.describe(session_id)
    assert found is not None and found.waiting_on is not None and found.next_action is not None
    return _Described.model_validate(found.model_dump())


def test_describe_of_a_finished_run(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(_plain())
    client.agent("plain").send("hi", session_id="d-fin")
    driver.drain("d-fin")
    found = _describe(client, "d-fin")
    assert (found.state, found.status, found.finish_reason, found.step) == ("finished", "finished", "stop", 1)
    assert found.usage.output_tokens == 40 and found.next_action.startswith("nothing: it is finished")
    assert found.waiting_on == summaries.WaitingOn()
    assert client.describe("no-such-run") is None
    with pytest.raises(errors.SessionIdInvalidError):
        client.describe("bad id!")


def test_describe_of_a_run_awaiting_approval(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(_desk())
    client.agent("desk").send("refund please", session_id="d-app")
    driver.drain("d-app")
    (approval,) = client.approvals.list()
    found = _describe(client, "d-app")
    assert found.state == "awaiting-approval" and found.finish_reason == "awaiting-approval"
    assert found.waiting_on.approval_ids == [approval.approval_id] and found.waiting_on.person
    assert found.next_action == f"a person: decide the approval(s) {approval.approval_id} (lousho approvals list)"


def test_describe_of_a_parked_run(store: PostgresCheckpointStore, client: Client) -> None:
    store.append_input("d-park", "plain", [Message(role="user", content="hi")])
    claim = store.claim("d-park", 3, None)
    assert claim.checkpoint is not None
    store.record_failure(
        "d-park",
        claim.checkpoint.fence,
        LastError(code="LOUSHO_PROVIDER_ERROR", message="400 bad request", retryable=False),
    )
    found = _describe(client, "d-park")
    assert found.state == "parked" and found.last_error is not None and found.waiting_on.person
    assert found.next_action == (
        "a person: it stopped on LOUSHO_PROVIDER_ERROR: 400 bad request; fix the cause, then resume it or send again"
    )


def test_describe_of_an_aborted_run(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(_desk())
    client.agent("desk").send("refund please", session_id="d-abort")
    assert client.abort("d-abort") is True
    driver.drain("d-abort")
    found = _describe(client, "d-abort")
    assert (found.state, found.finish_reason) == ("aborted", "aborted") and found.waiting_on.person
    assert found.next_action == "a person: it was aborted; send to it again, or resume it"


def test_describe_of_a_run_stopped_at_its_budget(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(_metered())
    client.agent("metered").send("work", session_id="d-budget")
    driver.drain("d-budget")
    found = _describe(client, "d-budget")
    assert (found.state, found.finish_reason) == ("budget-exceeded", "budget-exceeded") and found.waiting_on.person
    assert "resume it with raised limits" in found.next_action and found.usage.output_tokens == 80
    assert found.cost is None  # its agent has no prices: its workers recorded no cost


def test_describe_gives_the_cost_the_workers_recorded_at_the_agents_prices(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    prices = Prices(input=2.0, output=10.0)
    priced = Agent(
        name="priced",
        model=MockModel(
            [
                {"tool_calls": [{"name": "note", "args": {"text": "a"}}], "usage": USAGE},
                {"text": "done", "usage": USAGE},
            ]
        ),
        tools=[note],
        prices=prices,
    )
    driver = make_driver(priced)
    client.agent("priced").send("work", session_id="d-cost")
    driver.drain("d-cost")
    found = _describe(client, "d-cost")
    turn = prices.cost(Usage(input_tokens=10, output_tokens=40))
    assert found.state == "finished" and found.cost == pytest.approx(2 * turn)
    assert [run.cost for run in client.runs(agent="priced").items] == [None]  # a listing reads no events


def test_describe_of_a_lead_waiting_on_its_child_and_on_the_childs_approval(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore
) -> None:
    desk = _desk()
    driver = make_driver(_lead(desk), desk)
    _served(store, _lead(desk), desk)
    client.agent("lead").send("go", session_id="d-lead")
    driver.step("d-lead")  # the model turn
    driver.step()  # the batch: the child starts, the lead waits
    (child,) = [p.session_id for p in client.pending() if p.lead == "d-lead"]
    found = _describe(client, "d-lead")
    assert found.state == "waiting" and found.waiting_on.children == [child] and not found.waiting_on.person
    assert found.next_action == f"its sub-agents' runs {child}: the last to settle wakes it"
    # The child pauses on its refund: the lead is still waiting, and says on whose approval.
    driver.drain()
    (approval,) = client.approvals.list()
    assert approval.session_id == child
    lead = _describe(client, "d-lead")
    assert lead.state == "waiting" and lead.waiting_on.approval_ids == [approval.approval_id]
    assert lead.next_action == (
        f"a person: decide the approval(s) of its children {approval.approval_id} (lousho approvals list)"
    )
    assert _describe(client, child).state == "awaiting-approval"


def test_describe_of_a_retrying_run(store: PostgresCheckpointStore, client: Client) -> None:
    store.append_input("d-retry", "plain", [Message(role="user", content="hi")])
    claim = store.claim("d-retry", 3, None)
    assert claim.checkpoint is not None
    store.retry_later("d-retry", claim.checkpoint.fence, LastError(code="LOUSHO_PROVIDER_ERROR", retryable=True), 3600)
    found = _describe(client, "d-retry")
    assert found.state == "retrying" and found.failures == 1 and found.next_attempt_at is not None
    assert found.waiting_on.retry_at == found.next_attempt_at
    assert found.next_action.startswith("its next attempt at ") and found.next_action.endswith(
        "(resume() tries at once)"
    )


def test_describe_of_a_running_run_says_who_holds_it_or_where_its_step_message_is(
    client: Client, store: PostgresCheckpointStore, leases: LeaseManager, redis_client: redis.Redis
) -> None:
    _served(store, _plain())
    client.agent("plain").send("hi", session_id="d-run", check_agent=False)
    queued = _describe(client, "d-run")
    assert queued.state == "running" and queued.waiting_on.step_message == "queued"
    assert queued.next_action == "a worker takes its step message (queued)"

    # A worker took the message and has not acked it yet (the transport keeps it in its unacked hash).
    (key,) = [k for k in redis_client.scan_iter("lousho*") if redis_client.type(k) == b"list"]
    message = redis_client.rpop(key)
    assert isinstance(message, bytes)
    redis_client.hset("unacked", "tag-1", json.dumps([json.loads(message), "", key.decode()]))
    assert _describe(client, "d-run").waiting_on.step_message == "reserved"

    lease = leases.acquire("d-run")
    assert lease is not None
    held = _describe(client, "d-run")
    assert held.waiting_on.lease_holder == lease.owner and held.waiting_on.lease_age_ms is not None
    assert 0 <= held.waiting_on.lease_age_ms < leases.ttl_ms
    assert held.next_action == f"the worker {lease.owner} runs its step now"


def test_describe_of_a_run_nothing_moves_says_so_once_the_grace_is_over(
    client: Client, store: PostgresCheckpointStore, redis_client: redis.Redis
) -> None:
    client.agent("plain").send("hi", session_id="d-lost", check_agent=False)
    _drop_messages(redis_client)
    fresh = _describe(client, "d-lost")
    assert fresh.state == "running" and fresh.next_action.startswith("the recovery sweep, which sends it a step by")
    assert fresh.waiting_on.unserved_agent == "plain"  # no worker registered the agent here
    _backdate(store, "d-lost", 60)
    assert _describe(client, "d-lost").next_action.startswith("nothing seen moves it: no lease, no step message")


def test_runs_pages_every_run_newest_first_without_a_duplicate_or_a_gap(
    client: Client, store: PostgresCheckpointStore
) -> None:
    with store.engine.begin() as conn:  # 520 runs, some created in the same microsecond
        conn.execute(
            text("""INSERT INTO runs (session_id, agent, status, created_at, document)
                             SELECT 'pg-' || lpad(g::text, 4, '0'), CASE WHEN g % 2 = 0 THEN 'even' ELSE 'odd' END,
                                    CASE WHEN g % 3 = 0 THEN 'finished' ELSE 'in-progress' END,
                                    timestamptz '2025-01-01' + make_interval(secs => g / 4),
                                    '{"format": 2, "messages_count": 0, "step": 2}'
                             FROM generate_series(1, 520) g""")
        )
    seen: list[str] = []
    page = client.runs(limit=37)
    while True:
        seen.extend(run.session_id for run in page.items)
        if page.next_cursor is None:
            break
        page = client.runs(limit=37, cursor=page.next_cursor)
    assert len(seen) == len(set(seen)) == 520
    assert seen == sorted(seen, reverse=True)
    odd_finished = client.runs(agent="odd", state="finished", limit=500).items
    assert [r.session_id for r in odd_finished] == [f"pg-{g:04d}" for g in range(519, 0, -1) if g % 6 == 3]
    assert all(r.step == 2 and r.waiting_on is None and r.next_action is None for r in odd_finished)
    with pytest.raises(errors.ConfigurationError):
        client.runs(state="sleeping")
    with pytest.raises(errors.ConfigurationError):
        client.runs(limit=501)


def test_run_waits_on_a_run_started_elsewhere_and_delete_drops_it(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(_plain())
    client.agent("plain").send("hi", session_id="d-handle")  # as a webhook or lousho.start would
    handle = client.run("d-handle")
    assert handle is not None and client.run("d-unknown") is None
    driver.drain("d-handle")
    assert handle.wait(timeout=5).text == "Hello."
    assert [e.type for e in handle.events(timeout=5)][-1] == "run.done"
    assert client.delete("d-handle") is True and client.describe("d-handle") is None
    assert client.delete("d-handle") is False


def test_describe_of_a_run_waiting_on_a_model_slot(
    make_driver: Callable[..., Driver], client: Client, redis_client: redis.Redis, store: PostgresCheckpointStore
) -> None:
    # Given the one slot of a limit held elsewhere, and a run of an agent under it
    limit = ModelLimit("d-acct", concurrent=1)
    driver = make_driver(Agent(name="capped", model=MockModel(["Hello."]), model_limit=limit))
    driver.deps.slots = RedisModelSlots(redis_client, 2000)
    assert driver.deps.slots.acquire(limit, "d-elsewhere", "capped").granted
    client.agent("capped").send("hi", session_id="d-slot")
    # When its step finds no free slot
    assert driver.step("d-slot") == Outcome.WAITING
    # Then describe says it waits on a model slot (no failure, no attempt) and what wakes it
    found = _describe(client, "d-slot")
    assert found.state == "waiting" and found.last_error is None and found.attempts == 0
    assert (found.waiting_on.model_limit, found.waiting_on.model_limit_reason) == ("d-acct", "slot")
    assert found.next_action.startswith("waiting on a model slot of limit 'd-acct'")
    # ... and once the slot is freed and the woken step runs, the run finishes
    assert driver.deps.slots.release(limit, "d-elsewhere") == (("d-slot", "capped"),)
    driver.drain("d-slot")
    assert _describe(client, "d-slot").state == "finished"
