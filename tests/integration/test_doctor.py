"""The I19 checker on the real services: a run made unexplained on purpose (its lease and step messages removed by
hand, no sweep running) is found by ``Client.doctor``, ``lousho doctor`` and the ``lousho.doctor`` beat task, and
``lousho_runs_unexplained`` says so; runs with an owner, a timer or a waiter are never named, and the gauge reads 0
again once the run has a step message."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry
from sqlalchemy import text

from producer.cli import main
from producer.client import Client
from store import metrics
from store.checkpoints import PostgresCheckpointStore
from store.leases import Heartbeat, LeaseManager
from store.records import LastError, Message
from store.settings import Settings
from tests.support import services
from tests.support.cli_fixtures import Printed
from tests.support.driver import Driver
from worker import Agent, tasks, tool
from worker.providers import MockModel

pytestmark = pytest.mark.integration


@tool(needs_approval=True)
def refund(amount: int) -> str:
    """Refund the customer."""
    return f"refunded {amount}"


def _quiet(store: PostgresCheckpointStore, *session_ids: str, seconds: float = 60) -> None:
    """Make everything these runs did look ``seconds`` old: their saves and their input."""
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE runs SET updated_at = updated_at - make_interval(secs => :s), swept_at = NULL"
                " WHERE session_id = ANY(:ids)"
            ),
            {"s": seconds, "ids": list(session_ids)},
        )
        conn.execute(
            text("UPDATE inbox SET created_at = created_at - make_interval(secs => :s) WHERE session_id = ANY(:ids)"),
            {"s": seconds, "ids": list(session_ids)},
        )


def _drop_messages(redis_client: redis.Redis, session_id: str) -> None:
    """Remove the run's step messages from the broker's queues by hand."""
    for key in redis_client.scan_iter("lousho*"):
        if redis_client.type(key) == b"list":
            for raw in redis_client.lrange(key, 0, -1):
                _, kwargs, _ = json.loads(base64.b64decode(json.loads(raw)["body"]))
                if kwargs.get("session_id") == session_id:
                    redis_client.lrem(key, 0, raw)  # type: ignore[arg-type]  # redis-py types values as str only


def _gauge(store: PostgresCheckpointStore) -> float | None:
    registry = CollectorRegistry()
    registry.register(metrics.ApprovalsCollector(store.engine))
    return registry.get_sample_value("lousho_runs_unexplained")


def _healthy_runs(
    make_driver: Callable[..., Driver],
    client: Client,
    store: PostgresCheckpointStore,
    heartbeat: Heartbeat,
    redis_client: redis.Redis,
) -> None:
    """Quiet runs that something explains: a lease holder, a queued message, an approval, a retry time, parked."""
    desk = Agent(
        name="desk",
        model=MockModel([{"tool_calls": [{"name": "refund", "args": {"amount": 5}}]}, "ok"]),
        tools=[refund],
    )
    driver = make_driver(desk)
    client.agent("desk").send("refund", session_id="h-approval")
    driver.drain("h-approval")
    client.agent("desk").send("hi", session_id="h-queued")  # its message stays in the broker
    client.agent("desk").send("hi", session_id="h-held")
    _drop_messages(redis_client, "h-held")
    lease = driver.deps.leases.acquire("h-held")
    assert lease is not None
    heartbeat.hold(lease)  # renewed for as long as the test runs, as a worker holding the run does
    for sid, retryable in (("h-retry", True), ("h-parked", False)):
        store.append_input(sid, "desk", [Message(role="user", content="hi")])
        claim = store.claim(sid, 3, None)
        assert claim.checkpoint is not None
        if retryable:
            store.retry_later(sid, claim.checkpoint.fence, LastError(code="X", retryable=True), 3600)
        else:
            store.record_failure(sid, claim.checkpoint.fence, LastError(code="X", retryable=False))
    _quiet(store, "h-approval", "h-queued", "h-held", "h-retry", "h-parked")


@pytest.fixture
def heartbeat(leases: LeaseManager, settings: Settings) -> Iterator[Heartbeat]:
    beating = Heartbeat(leases, settings.lease_renew_ms)
    yield beating
    beating.stop()


def test_a_run_made_unexplained_on_purpose_is_found_and_the_gauge_says_so(
    make_driver: Callable[..., Driver],
    client: Client,
    store: PostgresCheckpointStore,
    heartbeat: Heartbeat,
    redis_client: redis.Redis,
    settings: Settings,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _healthy_runs(make_driver, client, store, heartbeat, redis_client)
    assert client.doctor().unexplained == () and _gauge(store) == 0

    # A run whose step message is lost and whose lease is gone, with no sweep to send it again.
    client.agent("desk").send("hi", session_id="lost-1", check_agent=False)
    _drop_messages(redis_client, "lost-1")
    _quiet(store, "lost-1")

    first = client.doctor(wait=False)
    assert [f.summary.session_id for f in first.suspects] == ["lost-1"] and first.unexplained == ()
    # Parked runs wait for a person by design and are not read; a suspect is not counted yet.
    assert first.checked == 5 and first.complete and _gauge(store) == 0
    found = client.doctor()  # looks again a sweep interval later: nothing moved it
    assert [f.summary.session_id for f in found.unexplained] == ["lost-1"] and found.suspects == ()
    (finding,) = found.unexplained
    assert finding.summary.state == "running" and finding.summary.next_action is not None
    assert finding.summary.next_action.startswith("nothing seen moves it: no lease, no step message")
    assert _gauge(store) == 1

    # The command says the same, and exits 3.
    for name, value in services.test_environment().items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = main(["doctor"])
    printed = Printed(code, *capsys.readouterr())
    assert printed.code == 3, printed
    assert "unexplained: lost-1  desk  running" in printed.out and "checked 5 unfinished run(s)" in printed.out
    code = main(["doctor", "--json"])
    as_json = Printed(code, *capsys.readouterr()).json()
    assert code == 3 and [r["session_id"] for r in as_json["unexplained"]] == ["lost-1"]

    # The beat task's look finds it too; once the run has a step message again, nothing is unexplained.
    monkeypatch.setattr(tasks, "settings", settings)
    monkeypatch.setitem(tasks._state, "pid", None)
    monkeypatch.setitem(tasks._state, "deps", None)
    try:
        assert tasks.doctor_look() == 1
        client.nudge("lost-1", agent="desk")
        assert tasks.doctor_look() == 0 and _gauge(store) == 0
    finally:
        built = tasks._state.get("deps")
        if built is not None:
            built.heartbeat.stop()
            built.store.engine.dispose()


def test_a_run_that_moves_between_two_looks_is_not_confirmed(
    client: Client, store: PostgresCheckpointStore, redis_client: redis.Redis
) -> None:
    client.agent("desk").send("hi", session_id="lost-2", check_agent=False)
    _drop_messages(redis_client, "lost-2")
    _quiet(store, "lost-2")
    assert [f.summary.session_id for f in client.doctor(wait=False).suspects] == ["lost-2"]
    # The sweep (or anyone) sends it a step: the second look sees the message and clears it.
    client.nudge("lost-2", agent="desk")
    second = client.doctor()
    assert second.unexplained == () and second.suspects == ()
    # Suspected again, then saved before the next look (its row changed): a new suspicion, not a confirmation.
    _drop_messages(redis_client, "lost-2")
    assert [f.summary.session_id for f in client.doctor(wait=False).suspects] == ["lost-2"]
    _age_suspicions(store, 10)
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE runs SET updated_at = now() - interval '59 seconds' WHERE session_id = 'lost-2'"))
    fourth = client.doctor(wait=False)
    assert [f.summary.session_id for f in fourth.suspects] == ["lost-2"] and fourth.unexplained == ()
    _age_suspicions(store, 10)
    assert [f.summary.session_id for f in client.doctor(wait=False).unexplained] == ["lost-2"]


def _age_suspicions(store: PostgresCheckpointStore, seconds: float) -> None:
    """Make the checker's earlier suspicions ``seconds`` older (as if that long passed between two looks)."""
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE doctor_runs SET first_seen = first_seen - make_interval(secs => :s)"), {"s": seconds})
