"""The real ``lousho.recover`` task body, run in this process on the test services.

It must send a step for every run that can move and is not moving, and never for a run that cannot
move (parked, paused, waiting for its retry time), however many of those there are.
"""

from __future__ import annotations

import time

import pytest
import redis
from sqlalchemy import text

from store.checkpoints import PostgresCheckpointStore
from store.leases import LeaseManager
from store.model_slots import RedisModelSlots
from store.records import LastError, Message, SweptRun
from store.registry import PostgresAgentRegistry
from tests.support.driver import Sent
from worker import Agent, ModelLimit, tasks
from worker.providers import MockModel
from worker.steps import Outcome, run_step

AGENT = "sweeper"


def _run(store: PostgresCheckpointStore, session_id: str, *, age_s: float = 3600, agent: str = AGENT) -> None:
    store.append_input(session_id, agent, [Message(role="user", content="hi")])
    with store.engine.begin() as conn:
        conn.execute(
            text("UPDATE runs SET updated_at = now() - make_interval(secs => :age) WHERE session_id = :sid"),
            {"age": age_s, "sid": session_id},
        )


def _claim(store: PostgresCheckpointStore, session_id: str) -> int:
    claim = store.claim(session_id, 10, None)
    assert claim.checkpoint is not None
    return claim.checkpoint.fence


def test_recover_sends_runs_that_can_move_and_never_those_that_cannot(
    store: PostgresCheckpointStore, sent: Sent
) -> None:
    PostgresAgentRegistry(store.engine).register("host:1", {AGENT: {"tools": {}}}, [1])
    for sid in ("stalled", "parked", "waiting", "due", "paused", "follow-up-parked", "fresh"):
        _run(store, sid, age_s=0 if sid == "fresh" else 3600)
    _run(store, "orphan", agent="retired")
    store.record_failure("parked", _claim(store, "parked"), LastError(code="X", retryable=False))
    store.retry_later("waiting", _claim(store, "waiting"), LastError(code="X", retryable=True), 3600)
    store.retry_later("due", _claim(store, "due"), LastError(code="X", retryable=True), 0)
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE runs SET status = 'awaiting-approval' WHERE session_id = 'paused'"))
        # A finished run whose follow-up failed for good before its input was merged
        conn.execute(
            text(
                'UPDATE runs SET status = \'finished\', last_error = \'{"code": "X", "retryable": false}\''
                " WHERE session_id = 'follow-up-parked'"
            )
        )

    assert tasks.recover() == 3
    assert sent.session_ids == {"stalled", "due", "orphan"}
    # Each goes to its agent's queue; a due retry gets a small spread, a lost message none
    by_id = {m[0]: m for m in sent.messages}
    assert by_id["stalled"][2:] == (0.0, AGENT)
    assert 0.0 <= by_id["due"][2] <= 5.0 and by_id["due"][3] == AGENT
    # A run of an agent no live worker serves goes to the shared queue, which every worker reads
    assert by_id["orphan"][3] is None


def test_runs_that_cannot_move_never_crowd_out_one_that_can(store: PostgresCheckpointStore, sent: Sent) -> None:
    # 600 parked runs (more than a sweep's page), all older than the one stalled run
    with store.engine.begin() as conn:
        conn.execute(
            text("""
            INSERT INTO runs (session_id, agent, status, updated_at, last_error, inbox_head)
            SELECT 'parked-' || g, :agent, CASE WHEN g % 2 = 0 THEN 'in-progress' ELSE 'finished' END,
                   now() - interval '2 hours', '{"code": "X", "retryable": false}', 1
            FROM generate_series(1, 600) AS g"""),
            {"agent": AGENT},
        )
    _run(store, "stalled", age_s=3600)

    assert tasks.recover() == 1
    assert sent.session_ids == {"stalled"}


def test_the_sweep_pages_past_runs_whose_lease_is_live(
    store: PostgresCheckpointStore, leases: LeaseManager, sent: Sent
) -> None:
    # 600 stalled-looking runs that are in fact running (a live lease each), older than one lost run
    with store.engine.begin() as conn:
        conn.execute(
            text("""
            INSERT INTO runs (session_id, agent, updated_at, inbox_head)
            SELECT 'busy-' || g, :agent, now() - interval '2 hours', 1 FROM generate_series(1, 600) AS g"""),
            {"agent": AGENT},
        )
    for g in range(1, 601):
        assert leases.acquire(f"busy-{g}") is not None
    _run(store, "lost", age_s=3600)

    assert tasks.recover() == 1
    assert sent.session_ids == {"lost"}


def test_a_run_sent_by_the_sweep_is_not_sent_again_until_a_lease_ttl_has_passed(
    store: PostgresCheckpointStore, sent: Sent
) -> None:
    # A backlog: the step the sweep sent is still queued when the next passes come
    _run(store, "queued-behind", age_s=3600)
    assert tasks.recover() == 1
    assert tasks.recover() == 0 and tasks.recover() == 0
    # Were that message lost, the run is sent again once a lease TTL has passed since
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE runs SET swept_at = now() - interval '1 hour'"))
    assert tasks.recover() == 1
    assert [m[0] for m in sent.messages] == ["queued-behind", "queued-behind"]


def test_the_sweep_tells_the_agent_once_how_a_run_it_sent_on_came_out(
    store: PostgresCheckpointStore, sent: Sent, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an agent with sweep callbacks, one of its runs silent for an hour, another that will be refused
    recovered: list[SweptRun] = []
    failed: list[tuple[LastError, SweptRun]] = []
    agent = Agent(
        AGENT,
        MockModel(["Done."]),
        on_recovered=recovered.append,
        on_error=lambda error, run: failed.append((error, run)),
    )
    monkeypatch.setitem(tasks.extra_agents, AGENT, agent)
    _run(store, "stalled")
    _run(store, "refused")
    # When the sweep sends both on, the first finishes and the second fails for good
    assert tasks.recover() == 2
    assert tasks.recover() == 0 and recovered == [] and failed == []  # nothing came out yet
    assert run_step(tasks.deps(), "stalled") is Outcome.FINISHED
    store.record_failure("refused", _claim(store, "refused"), LastError(code="X", message="no", retryable=False))
    tasks.recover()
    # Then the next pass reports each once, and no later pass again
    tasks.recover()
    assert [(r.session_id, r.status, r.finish_reason) for r in recovered] == [("stalled", "finished", "stop")]
    assert [(e.code, r.session_id) for e, r in failed] == [("X", "refused")]
    assert store.settle_recoveries([AGENT]) == []


def test_the_sweep_leaves_a_run_waiting_on_a_model_slot_alone_and_gives_a_dead_holders_slot_to_it(
    store: PostgresCheckpointStore, sent: Sent, redis_client: redis.Redis
) -> None:
    # Given a run whose step found no free slot long ago (its save is old), the slot held by a process that died
    limit = ModelLimit("sweep-acct", concurrent=1)
    slots = tasks.deps().slots
    assert slots is not None
    # The holder's slot lives 300 ms unless renewed (a step's slot lives a lease TTL).
    holder = RedisModelSlots(redis_client, 300)
    assert holder.acquire(limit, "holder", AGENT).granted
    _run(store, "slot-waiter", age_s=3600)
    assert not slots.acquire(limit, "slot-waiter", AGENT).granted
    # When the sweep passes while the holder's slot is live: the waiter is explained, nothing is sent
    assert tasks.recover() == 0 and sent.session_ids == set()
    # When the holder's slot has expired (it never renewed it), the next pass gives it to the waiter
    time.sleep(0.4)
    assert tasks.recover() == 1
    assert sent.messages[0][0] == "slot-waiter" and sent.messages[0][3] is None
