"""Retention on the real services: old finished runs go with everything kept under their ids, in bounded batches;
runs that can still continue stay, sub-agent runs go with their lead and never before it, and delivery ids, body
hashes and ticks outlive their runs, so a webhook redelivery after pruning still starts nothing. Steps in-process."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from store import errors, retention
from store.approvals import PostgresApprovalStore
from store.checkpoints import PostgresCheckpointStore
from store.records import Message
from store.retention import Retention
from store.settings import Settings
from tests.support.cli_fixtures import Lousho
from tests.support.driver import Driver, Sent
from tests.support.http_fixtures import Receiver, receiver, signed_headers  # noqa: F401  # receiver is a fixture
from worker import Agent, ToolContext, tool
from worker.providers import MockModel

MONTH = timedelta(days=30)
#: The tables that hold a run's state under its id, all pruned with it.
RUN_TABLES = ("runs", "checkpoint_history", "run_messages", "run_events", "inbox", "sends", "approvals")


@tool(needs_approval=True)
def ship(order: int, ctx: ToolContext) -> str:
    """Ship an order."""
    return f"shipped {order}"


@tool
def look(topic: str) -> str:
    """Look a topic up."""
    return f"notes on {topic}"


SHOP = Agent(
    name="shop", model=MockModel([{"tool_calls": [{"name": "ship", "args": {"order": 7}}]}, "Shipped."]), tools=[ship]
)


def _researcher() -> Agent:
    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {"tool_calls": [{"name": "look", "args": {"topic": str(messages[-1].content)}}]}
        return f"found: {messages[-1].content}"

    return Agent(name="researcher", model=MockModel(answer), tools=[look])


def _lead(researcher: Agent) -> Agent:
    def answer(messages: list[Message]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return {
                "tool_calls": [
                    {"name": "task", "args": {"agent": "researcher", "prompt": "tides"}},
                    {"name": "task", "args": {"agent": "researcher", "prompt": "winds"}},
                ]
            }
        return "report done"

    return Agent(name="lead", model=MockModel(answer), tools=[look], subagents=[researcher])


def _send(store: PostgresCheckpointStore, session_id: str, agent: str, content: str = "Ship order 7") -> None:
    store.append_input(session_id, agent, [Message(role="user", content=content)], f"req-{session_id}")


def _finished_shop_run(driver: Driver, store: PostgresCheckpointStore, session_id: str) -> None:
    """A run of ``shop`` that paused on its approval, was approved and finished: rows in each run table but inbox."""
    _send(store, session_id, "shop")
    driver.drain(session_id)
    approvals = PostgresApprovalStore(store.engine)
    (pending,) = [a for a in approvals.pending("shop") if a.session_id == session_id]
    approvals.resolve(pending.approval_id, approved=True)
    driver.drain(session_id)
    checkpoint = store.load(session_id)
    assert checkpoint is not None and checkpoint.status == "finished"


def _age(engine: Engine, *session_ids: str, days: float = 40) -> None:
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE runs SET updated_at = now() - make_interval(days => :days) WHERE session_id = ANY(:ids)"),
            {"days": days, "ids": list(session_ids)},
        )


def _rows(engine: Engine, session_id: str) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            table: int(
                conn.execute(
                    text(f"SELECT count(*) FROM {table} WHERE session_id = :sid"), {"sid": session_id}
                ).scalar_one()
            )
            for table in RUN_TABLES
        }


def _count(engine: Engine, sql: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())


def _insert_run(engine: Engine, session_id: str, days: float = 40, **columns: Any) -> str:
    """A run written directly, last saved ``days`` ago, finished unless ``columns`` say otherwise."""
    values = {"status": "finished", **columns}
    names, params = ", ".join(values), ", ".join(f":{name}" for name in values)
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO runs (session_id, agent, updated_at, {names})"
                f" VALUES (:sid, 'shop', now() - make_interval(days => :days), {params})"
            ),
            {"sid": session_id, "days": days, **values},
        )
    return session_id


def _insert_runs(engine: Engine, prefix: str, n: int, days: float = 40, **columns: Any) -> list[str]:
    return [_insert_run(engine, f"{prefix}-{i:03d}", days, **columns) for i in range(n)]


def _insert_keys(engine: Engine, prefix: str, n: int, days: float, *, run_of: str | None = None) -> None:
    """``n`` delivery ids, body hashes and claimed ticks received ``days`` ago (deliveries of run ``run_of``)."""
    with engine.begin() as conn:
        schedule_id = conn.execute(
            text("""
            INSERT INTO schedules (name, agent, input, every_s, next_fire_at) VALUES (:name, 'shop', '[]', 60, now())
            ON CONFLICT (name) DO UPDATE SET paused = false RETURNING schedule_id"""),
            {"name": prefix},
        ).scalar_one()
        for i in range(n):
            params = {
                "id": f"{prefix}-{i}",
                "sid": run_of or f"job-gone-{prefix}-{i}",
                "days": days,
                "schedule": schedule_id,
                "i": i,
            }
            conn.execute(
                text("""INSERT INTO deliveries (agent, delivery_id, session_id, source, body_sha256,
                                                         received_at)
                                 VALUES ('shop', :id, :sid, 'standard', md5(:id),
                                         now() - make_interval(days => :days))"""),
                params,
            )
            conn.execute(
                text("""INSERT INTO delivery_bodies (agent, body_sha256, delivery_id, received_at)
                                 VALUES ('shop', md5(:id), :id, now() - make_interval(days => :days))"""),
                params,
            )
            conn.execute(
                text("""INSERT INTO schedule_fires (schedule_id, fire_at, session_id, outcome, claimed_at)
                                 VALUES (:schedule, now() - make_interval(days => :days, mins => :i), :sid, 'fired',
                                         now() - make_interval(days => :days))"""),
                params,
            )


@pytest.fixture
def shop_driver(make_driver: Callable[..., Driver]) -> Driver:
    return make_driver(SHOP)


def test_an_old_finished_run_goes_with_its_history_messages_events_send_keys_and_approvals(
    shop_driver: Driver, store: PostgresCheckpointStore
) -> None:
    for session_id in ("ret-old", "ret-recent"):
        _finished_shop_run(shop_driver, store, session_id)
    before = _rows(store.engine, "ret-old")
    # The run left rows in every table but the inbox, whose rows go with the save that reads them.
    assert all(count for table, count in before.items() if table != "inbox") and not before["inbox"], before
    _age(store.engine, "ret-old")

    pruned = retention.prune(store.engine, MONTH)

    assert _rows(store.engine, "ret-old") == dict.fromkeys(RUN_TABLES, 0)
    assert (
        pruned.runs,
        pruned.history,
        pruned.messages,
        pruned.events,
        pruned.inputs,
        pruned.sends,
        pruned.approvals,
    ) == tuple(before[table] for table in RUN_TABLES)
    assert not pruned.more
    assert store.load("ret-recent") is not None and _rows(store.engine, "ret-recent") == before


def test_a_send_to_a_pruned_run_id_starts_a_new_run_with_no_memory_of_the_old_one(
    shop_driver: Driver, store: PostgresCheckpointStore
) -> None:
    _finished_shop_run(shop_driver, store, "ret-again")
    old, old_events = store.load("ret-again"), store.read_events("ret-again", -1)
    assert old is not None
    _age(store.engine, "ret-again")
    assert retention.prune(store.engine, MONTH).runs == 1

    _send(store, "ret-again", "shop", "Where is order 7?")  # the same idempotency key: it went with the run
    shop_driver.drain("ret-again")

    checkpoint = store.load("ret-again")
    assert checkpoint is not None and checkpoint.status == "awaiting-approval"
    assert [m.content for m in checkpoint.messages if m.role == "user"] == ["Where is order 7?"]
    assert checkpoint.seq < old.seq and _rows(store.engine, "ret-again")["approvals"] == 1
    assert len(store.read_events("ret-again", -1)) < len(old_events)


def test_runs_that_can_still_continue_are_never_pruned(store: PostgresCheckpointStore) -> None:
    kept = [
        _insert_run(store.engine, "ret-running", status="in-progress"),
        _insert_run(store.engine, "ret-paused", status="awaiting-approval"),
        _insert_run(store.engine, "ret-aborted", status="in-progress", aborted=True),
        _insert_run(store.engine, "ret-parked", status="in-progress", last_error='{"code": "X", "retryable": false}'),
        _insert_run(store.engine, "ret-unread", inbox_head=1),
        _insert_run(store.engine, "ret-hooks", end_due=True),
        _insert_run(store.engine, "ret-waiting", waiting=True),
    ]
    due = _insert_run(store.engine, "ret-due")

    pruned = retention.prune(store.engine, MONTH)

    assert pruned.runs == 1
    assert store.load(due) is None
    assert all(store.load(session_id) is not None for session_id in kept)


def test_sub_agent_runs_go_with_their_lead_and_never_before_it(
    make_driver: Callable[..., Driver], store: PostgresCheckpointStore
) -> None:
    researcher = _researcher()
    driver = make_driver(_lead(researcher), researcher)
    _send(store, "ret-lead", "lead", "research")
    driver.drain("ret-lead")
    lead = store.load("ret-lead")
    assert lead is not None and lead.status == "finished"
    with store.engine.connect() as conn:
        children = list(conn.execute(text("SELECT session_id FROM runs WHERE parent_id = 'ret-lead'")).scalars())
    assert len(children) == 2 and all(_rows(store.engine, child)["run_messages"] for child in children)

    _age(store.engine, *children, days=60)  # the children are old, their lead is not
    assert retention.prune(store.engine, MONTH).runs == 0
    assert all(store.load(child) is not None for child in children)

    _age(store.engine, "ret-lead")
    pruned = retention.prune(store.engine, MONTH)

    assert pruned.runs == 3
    for session_id in ("ret-lead", *children):
        assert _rows(store.engine, session_id) == dict.fromkeys(RUN_TABLES, 0)


def test_a_lead_whose_sub_agent_run_is_unfinished_stays(store: PostgresCheckpointStore) -> None:
    lead = _insert_run(store.engine, "ret-lead")
    child = _insert_run(store.engine, f"{lead}.task-00000000000000a1", parent_id=lead)
    grandchild = _insert_run(
        store.engine, f"{child}.task-00000000000000b2", parent_id=child, status="awaiting-approval"
    )

    assert retention.prune(store.engine, MONTH).runs == 0

    with store.engine.begin() as conn:
        conn.execute(text("UPDATE runs SET status = 'finished' WHERE session_id = :sid"), {"sid": grandchild})
    assert retention.prune(store.engine, MONTH).runs == 3


def test_a_finished_lead_goes_with_its_parked_aborted_and_stopped_children(store: PostgresCheckpointStore) -> None:
    lead = _insert_run(store.engine, "ret-ended")
    parked = _insert_run(
        store.engine,
        f"{lead}.task-00000000000000d1",
        parent_id=lead,
        status="in-progress",
        last_error='{"code": "LOUSHO_TOOL_PROPAGATED", "retryable": false}',
    )
    aborted = _insert_run(
        store.engine,
        f"{lead}.task-00000000000000d2",
        parent_id=lead,
        status="in-progress",
        aborted=True,
        document='{"finish_reason": "aborted"}',
    )
    stopped = _insert_run(
        store.engine,
        f"{lead}.task-00000000000000d3",
        parent_id=lead,
        status="in-progress",
        aborted=True,
        document='{"finish_reason": "budget-exceeded"}',
    )
    below = _insert_run(store.engine, f"{parked}.task-00000000000000d4", parent_id=parked)

    due = retention.count_due(store.engine, MONTH)
    pruned = retention.prune(store.engine, MONTH)

    assert (due.runs, pruned.runs) == (5, 5)
    assert all(store.load(run) is None for run in (lead, parked, aborted, stopped, below))


def test_a_child_that_can_still_move_keeps_its_finished_lead(store: PostgresCheckpointStore) -> None:
    lead = _insert_run(store.engine, "ret-moving")
    _insert_run(
        store.engine,
        f"{lead}.task-00000000000000e1",
        parent_id=lead,
        status="in-progress",
        last_error='{"code": "LOUSHO_PROVIDER_REQUEST_FAILED", "retryable": true}',
    )
    _insert_run(
        store.engine, f"{lead}.task-00000000000000e2", parent_id=lead, status="in-progress", aborted=True, inbox_head=1
    )  # stopped, with input a step has not applied yet

    assert retention.prune(store.engine, MONTH).runs == 0


def test_a_settled_child_whose_lead_is_gone_is_pruned_on_its_own(store: PostgresCheckpointStore) -> None:
    parked = _insert_run(
        store.engine,
        "ret-gone.task-00000000000000f1",
        parent_id="ret-gone",
        status="in-progress",
        last_error='{"code": "LOUSHO_LEAD_GONE", "retryable": false}',
    )
    finished = _insert_run(store.engine, "ret-gone.task-00000000000000f2", parent_id="ret-gone")
    below = _insert_run(store.engine, f"{finished}.task-00000000000000f3", parent_id=finished)
    moving = _insert_run(store.engine, "ret-gone.task-00000000000000f4", parent_id="ret-gone", status="in-progress")
    young = _insert_run(store.engine, "ret-gone.task-00000000000000f5", parent_id="ret-gone", days=1)

    due = retention.count_due(store.engine, MONTH)
    pruned = retention.prune(store.engine, MONTH)

    assert (due.runs, pruned.runs) == (3, 3)
    assert all(store.load(run) is None for run in (parked, finished, below))
    assert store.load(moving) is not None and store.load(young) is not None


def test_a_webhook_redelivery_after_its_run_was_pruned_starts_nothing(receiver: Receiver) -> None:  # noqa: F811
    client = TestClient(receiver.app)
    body = json.dumps({"event": "order.paid", "order": 7}).encode()

    def deliver() -> dict[str, Any]:
        response = client.post(
            "/webhooks/hooks", content=body, headers=signed_headers(body, "ret-evt-1", int(time.time()))
        )
        assert response.status_code == 202
        answer: dict[str, Any] = response.json()
        return answer

    session_id = deliver()["session_id"]
    receiver.driver.drain()
    _age(receiver.engine, session_id)
    pruned = retention.prune(receiver.engine, MONTH)
    assert pruned.runs == 1 and pruned.deliveries == 0

    again = deliver()

    assert again["duplicate"] is True and again["status"] == "deleted" and again["session_id"] == session_id
    assert not receiver.driver.queue and receiver.store.load(session_id) is None
    assert _count(receiver.engine, "SELECT count(*) FROM runs") == 0

    # Past the keys' age the delivery id goes too, and only then would the same delivery start a run again.
    with receiver.engine.begin() as conn:
        conn.execute(text("UPDATE deliveries SET received_at = now() - interval '121 days'"))
    assert retention.prune(receiver.engine, MONTH).deliveries == 1
    assert deliver()["duplicate"] is False


def test_keys_outlive_their_runs_and_go_after_their_own_age(store: PostgresCheckpointStore) -> None:
    _insert_keys(store.engine, "ret-young", 3, days=100)
    _insert_keys(store.engine, "ret-old", 4, days=130)
    live = _insert_run(store.engine, "ret-live", status="in-progress")
    _insert_keys(store.engine, "ret-live", 2, days=400, run_of=live)

    pruned = retention.prune(store.engine, MONTH)  # keys: 4 x 30 days

    assert (pruned.deliveries, pruned.bodies, pruned.ticks) == (4, 6, 6)
    assert _count(store.engine, "SELECT count(*) FROM deliveries") == 3 + 2  # the live run's ids stay
    assert _count(store.engine, "SELECT count(*) FROM delivery_bodies") == 3
    assert _count(store.engine, "SELECT count(*) FROM schedule_fires") == 3
    assert retention.prune(store.engine, MONTH, keys_older_than=timedelta(days=90)).deliveries == 3
    with pytest.raises(errors.ConfigurationError):
        retention.prune(store.engine, MONTH, keys_older_than=timedelta(days=29))


def test_each_batch_is_bounded_and_batches_go_on_until_nothing_is_due(store: PostgresCheckpointStore) -> None:
    _insert_runs(store.engine, "ret-many", 25)
    _insert_keys(store.engine, "ret-many", 12, days=200)

    runs = [retention.prune_runs(store.engine, MONTH, 10) for _ in range(4)]
    keys = [retention.prune_keys(store.engine, timedelta(days=120), 5) for _ in range(4)]

    assert [(r.runs, r.more) for r in runs] == [(10, True), (10, True), (5, False), (0, False)]
    assert [(k.deliveries, k.bodies, k.ticks, k.more) for k in keys] == [
        (5, 5, 5, True),
        (5, 5, 5, True),
        (2, 2, 2, False),
        (0, 0, 0, False),
    ]


def test_a_sweep_pass_runs_at_most_its_batches_and_says_when_work_is_left(store: PostgresCheckpointStore) -> None:
    _insert_runs(store.engine, "ret-sweep", 25)
    _insert_keys(store.engine, "ret-sweep", 3, days=200)
    policy = Retention.from_days(30)

    first = retention.sweep(store.engine, policy, 10, batches=2)
    second = retention.sweep(store.engine, policy, 10, batches=2)

    assert (first.runs, first.deliveries, first.more) == (20, 3, True)
    assert (second.runs, second.deliveries, second.more) == (5, 0, False)
    assert retention.sweep(store.engine, Retention.from_days(None), 10) == retention.PruneResult()


def test_a_run_another_transaction_holds_is_skipped_and_pruned_by_a_later_pass(store: PostgresCheckpointStore) -> None:
    held, free = _insert_runs(store.engine, "ret-lock", 2)
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store.engine.begin() as conn:
            conn.execute(text("SELECT 1 FROM runs WHERE session_id = :sid FOR UPDATE"), {"sid": held})
            locked.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        pruned = retention.prune_runs(store.engine, MONTH)
        assert pruned.runs == 1 and store.load(free) is None and store.load(held) is not None
    finally:
        release.set()
        holder.join(10)
    assert retention.prune_runs(store.engine, MONTH).runs == 1 and store.load(held) is None


def test_count_due_counts_what_the_batches_then_delete(store: PostgresCheckpointStore) -> None:
    lead = _insert_run(store.engine, "ret-count")
    _insert_run(store.engine, f"{lead}.task-00000000000000c3", parent_id=lead)
    _insert_runs(store.engine, "ret-count-more", 3)
    _insert_runs(store.engine, "ret-count-new", 2, days=1)
    _insert_keys(store.engine, "ret-count", 2, days=200)

    due = retention.count_due(store.engine, MONTH)
    pruned = retention.prune(store.engine, MONTH)

    assert (due.runs, due.deliveries, due.bodies, due.ticks) == (5, 2, 2, 2)
    assert (pruned.runs, pruned.deliveries, pruned.bodies, pruned.ticks) == (5, 2, 2, 2)
    assert retention.count_due(store.engine, MONTH) == retention.PruneResult()


def test_the_batches_read_indexes_not_whole_tables(store: PostgresCheckpointStore) -> None:
    with store.engine.begin() as conn:
        conn.execute(
            text("""INSERT INTO runs (session_id, agent, status, updated_at)
                             SELECT 'ret-plan-' || g, 'shop',
                                    CASE WHEN g % 3 = 0 THEN 'in-progress' ELSE 'finished' END,
                                    now() - make_interval(days => g % 400) FROM generate_series(1, 3000) g""")
        )
        # A sub-agent run under every tenth of them (and a few whose lead is gone).
        conn.execute(
            text("""INSERT INTO runs (session_id, agent, status, parent_id, updated_at)
                             SELECT 'ret-plan-' || g || '.task-' || lpad(to_hex(g), 16, '0'), 'shop', 'finished',
                                    CASE WHEN g % 100 = 0 THEN 'ret-gone-' || g ELSE 'ret-plan-' || g END,
                                    now() - make_interval(days => g % 400)
                             FROM generate_series(10, 3000, 10) g""")
        )
        for table, column in (("deliveries", "received_at"), ("delivery_bodies", "received_at")):
            extra = (
                ("session_id, source, body_sha256", "'ret-plan-' || g, 'standard', md5(g::text)")
                if table == "deliveries"
                else ("body_sha256", "md5(g::text)")
            )
            conn.execute(
                text(f"""INSERT INTO {table} (agent, delivery_id, {extra[0]}, {column})
                                  SELECT 'shop', 'd' || g, {extra[1]}, now() - make_interval(days => g % 400)
                                  FROM generate_series(1, 3000) g""")
            )
        schedule_id = conn.execute(
            text(
                "INSERT INTO schedules (name, agent, input, every_s, next_fire_at)"
                " VALUES ('ret-plan', 'shop', '[]', 60, now()) RETURNING schedule_id"
            )
        ).scalar()
        conn.execute(
            text("""INSERT INTO schedule_fires (schedule_id, fire_at, session_id, outcome, claimed_at)
                             SELECT :id, now() - make_interval(hours => g), 'ret-plan-' || g, 'fired',
                                    now() - make_interval(hours => g) FROM generate_series(1, 9000) g"""),
            {"id": schedule_id},
        )
        conn.execute(text("ANALYZE runs; ANALYZE deliveries; ANALYZE delivery_bodies; ANALYZE schedule_fires"))

    plans = retention.batch_plans(store.engine, MONTH)

    indexes = {
        "runs": "runs_retention_idx",
        "orphans": "runs_parent_idx",
        "deliveries": "deliveries_received_idx",
        "bodies": "delivery_bodies_received_idx",
        "ticks": "schedule_fires_claimed_idx",
    }
    for name, index in indexes.items():
        plan = "\n".join(plans[name])
        assert f"Index Scan using {index}" in plan and "Seq Scan" not in plan, plan


def test_ages_and_policies_are_checked() -> None:
    assert retention.parse_age("30d") == MONTH and retention.parse_age("1w 12h") == timedelta(days=7.5)
    assert retention.parse_age("90m") == timedelta(minutes=90)
    for bad in ("30", "0d", "d", "3 days", "-1d", ""):
        with pytest.raises(errors.ConfigurationError):
            retention.parse_age(bad)
    assert Retention.from_days(None, 90) == Retention()
    assert Retention.from_days(2) == Retention(runs=timedelta(days=2), keys=timedelta(days=30))
    assert Retention.from_days(30) == Retention(runs=MONTH, keys=timedelta(days=120))
    assert Retention.from_days(30, 45).keys == timedelta(days=45)
    with pytest.raises(errors.ConfigurationError, match="LOUSHO_RETENTION_KEYS_DAYS"):
        Retention.from_days(30, 10)
    with pytest.raises(errors.ConfigurationError, match="LOUSHO_RETENTION_DAYS"):
        Retention.from_days(0)


def test_lousho_prune_counts_with_dry_run_then_prunes_batch_by_batch(
    lousho: Lousho,  # the fixture, by name
    store: PostgresCheckpointStore,
) -> None:
    _insert_runs(store.engine, "ret-cli", 7)
    _insert_runs(store.engine, "ret-cli-new", 2, days=1)
    _insert_keys(store.engine, "ret-cli", 2, days=200)

    dry = lousho("prune", "--older-than", "30d", "--dry-run", "--json")
    assert dry.code == 0 and (dry.json()["runs"], dry.json()["deliveries"]) == (7, 2)
    assert _count(store.engine, "SELECT count(*) FROM runs") == 9

    done = lousho("prune", "--older-than", "30d", "--batch", "3", "--json")
    assert done.code == 0
    assert (done.json()["runs"], done.json()["batches"], done.json()["deliveries"]) == (7, 3, 2)
    assert _count(store.engine, "SELECT count(*) FROM runs") == 2

    again = lousho("prune", "--older-than", "30d")
    assert again.code == 0 and again.out.startswith("pruned 0 run(s)")
    assert lousho("prune", "--older-than", "30").code == 2  # an age needs its unit
    refused = lousho("prune", "--older-than", "30d", "--keys-older-than", "7d")
    assert refused.code == 1 and refused.error_code() == "LOUSHO_CONFIG_INVALID"


def test_the_beat_prunes_once_retention_is_set(
    settings: Settings, sent: Sent, store: PostgresCheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker import celery, tasks

    _insert_runs(store.engine, "ret-beat", 3)
    assert tasks.prune() == 0  # LOUSHO_RETENTION_DAYS unset: everything is kept
    assert _count(store.engine, "SELECT count(*) FROM runs") == 3

    monkeypatch.setattr(tasks, "settings", settings.model_copy(update={"retention_days": 30.0}))
    assert tasks.prune() == 3

    assert "lousho-prune" not in celery.beat_schedule(settings)
    entry = celery.beat_schedule(settings.model_copy(update={"retention_days": 30.0}))["lousho-prune"]
    assert entry["task"] == "lousho.prune" and entry["schedule"] == settings.retention_interval_s
    assert celery.app.conf.task_routes["lousho.prune"]["queue"] == celery.control_queue(celery.settings)
