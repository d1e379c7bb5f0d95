"""Schedule fixtures: the schedule store and producer API on the test services, and a step driver for their runs."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from producer.client import Client
from producer.schedules import Schedules
from store.checkpoints import PostgresCheckpointStore
from store.leases import Heartbeat, LeaseManager
from store.schedules import PostgresScheduleStore
from store.settings import Settings
from tests.support import services
from worker import Agent
from worker.providers import MockModel
from worker.steps import Outcome, StepDeps, run_step

REPORTER = Agent(name="reporter", model=MockModel(["Report sent."]), instructions="Send the report.")


@pytest.fixture
def schedule_store(store: PostgresCheckpointStore) -> PostgresScheduleStore:
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        conn.execute("TRUNCATE deliveries, schedules, schedule_fires")
    store.register_agents({REPORTER.name: REPORTER.fingerprint()})
    return PostgresScheduleStore(store.engine)


@pytest.fixture
def schedules(
    schedule_store: PostgresScheduleStore, settings: Settings, store: PostgresCheckpointStore
) -> Iterator[Schedules]:
    with Client(settings, engine=store.engine) as client:
        yield Schedules(client)


@pytest.fixture
def finish(store: PostgresCheckpointStore, leases: LeaseManager, settings: Settings) -> Iterator[object]:
    """``finish(session_id)`` runs the run's steps in this process until it settles."""
    heartbeat = Heartbeat(leases, settings.lease_renew_ms)
    queue: list[tuple[str, int | None]] = []

    def enqueue(
        session_id: str, seq: int | None, countdown: float = 0.0, agent: str | None = None, *, name: str | None = None
    ) -> None:
        queue.append((session_id, seq))

    deps = StepDeps(store=store, leases=leases, heartbeat=heartbeat, agents={REPORTER.name: REPORTER}, enqueue=enqueue)

    def run(session_id: str) -> list[Outcome]:
        queue.append((session_id, None))
        outcomes = []
        while queue:
            sid, seq = queue.pop(0)
            outcomes.append(run_step(deps, sid, seq))
        return outcomes

    yield run
    heartbeat.stop()
