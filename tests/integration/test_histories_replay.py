"""Recorded runs from the first release of the schema still load, migrate and resume.

Each fixture holds the raw rows a run left behind at a given schema revision. The test writes
them into a database at that revision, upgrades it to the newest schema, and finishes the run
with today's code: later schema changes must keep old runs working.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from producer.client import Client
from store.checkpoints import PostgresCheckpointStore
from store.database import make_engine, migrate
from store.leases import LeaseManager
from store.settings import Settings
from tests.support import services
from tests.support.driver import no_enqueue
from tests.support.history_agents import effects, travel_agent

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parents[1] / "support" / "histories"
JSON_COLUMNS = {"document", "last_error", "messages", "args", "fingerprint", "uncounted_usage"}


def _load(name: str) -> dict[str, Any]:
    fixture: dict[str, Any] = json.loads((HERE / f"{name}.json").read_text())
    return fixture


@pytest.fixture
def replay_settings(settings: Settings) -> Iterator[Settings]:
    """A database of its own, so it can be built at an old revision."""
    yield services.own_database(settings, f"{services.TEST_DATABASE}_replay")


def _restore(settings: Settings, fixture: dict[str, Any]) -> None:
    migrate(settings, fixture["revision"])
    url = settings.sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as conn:
        for table in ("runs", "checkpoint_history", "inbox", "approvals"):
            for row in fixture[table]:
                columns = list(row)
                values = [Jsonb(row[c]) if c in JSON_COLUMNS and row[c] is not None else row[c] for c in columns]
                conn.execute(
                    sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                        sql.Identifier(table),
                        sql.SQL(", ").join(map(sql.Identifier, columns)),
                        sql.SQL(", ").join(sql.Placeholder() * len(columns)),
                    ),
                    values,
                )
    migrate(settings)


@pytest.fixture(autouse=True)
def _clear_effects() -> None:
    effects.clear()


def _driver(replay_settings: Settings, leases, make_store):  # type: ignore[no-untyped-def]
    from store.leases import Heartbeat
    from tests.support.driver import Driver
    from worker.steps import StepDeps

    store = make_store(replay_settings)
    driver = Driver(
        StepDeps(
            store=store,
            leases=leases,
            heartbeat=Heartbeat(leases, 500),
            agents={"travel": travel_agent()},
            enqueue=no_enqueue,
        )
    )
    driver.deps.enqueue = driver.enqueue
    return store, driver


@pytest.fixture
def make_store() -> Iterator[Any]:
    engines = []

    def make(settings: Settings) -> PostgresCheckpointStore:
        engine = make_engine(settings)
        engines.append(engine)
        return PostgresCheckpointStore(engine, settings.history_limit)

    yield make
    for engine in engines:
        engine.dispose()


def test_a_run_interrupted_mid_batch_resumes_without_rerunning_the_recorded_call(
    replay_settings: Settings, leases: LeaseManager, make_store: Callable[[Settings], PostgresCheckpointStore]
) -> None:
    _restore(replay_settings, _load("v1_interrupted_batch"))
    store, driver = _driver(replay_settings, leases, make_store)
    assert [e.step for e in store.history("hist-batch")] == [1, 1]
    with Client(replay_settings, engine=store.engine) as client:
        run = client.agent("travel").resume("hist-batch")
        assert run is not None
        driver.drain("hist-batch")
        paused = run.wait(timeout=5)
        assert effects == ["call_0_1"]  # only the call without a recorded result ran
        assert paused.finish_reason == "awaiting-approval"
        done = client.agent("travel").approvals.resolve(paused.approval_id, approved=True)  # type: ignore[arg-type]
        driver.drain("hist-batch")
        result = done.wait(timeout=5)
    assert result.text == "Booked Rome: sunny there." and effects == ["call_0_1", "book Rome"]
    assert [m.tool_call_id for m in result.messages if m.role == "tool"] == ["call_0_0", "call_0_1", "call_1_0"]


def test_a_run_paused_on_an_approval_is_decided_and_finished(
    replay_settings: Settings, leases: LeaseManager, make_store: Callable[[Settings], PostgresCheckpointStore]
) -> None:
    fixture = _load("v1_awaiting_approval")
    _restore(replay_settings, fixture)
    store, driver = _driver(replay_settings, leases, make_store)
    with Client(replay_settings, engine=store.engine) as client:
        (pending,) = client.agent("travel").approvals.list()
        assert pending.tool_name == "book" and pending.args == {"city": "Rome"}
        run = client.agent("travel").approvals.resolve(pending.approval_id, approved=False, note="not now")
        driver.drain("hist-paused")
        result = run.wait(timeout=5)
    assert result.text == "Booked Rome: sunny there." and effects == []
    rejection = json.loads([m for m in result.messages if m.role == "tool"][-1].content)
    assert rejection["kind"] == "rejected" and rejection["note"] == "not now"
    assert len(store.history("hist-paused")) > len(fixture["checkpoint_history"])
