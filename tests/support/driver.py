"""An in-process step driver on the real services, shared by the integration-style tiers.

``make_driver(*agents)`` gives a ``Driver`` that runs real steps (``worker.steps.run_step``) in the
test process and delivers the messages they enqueue; ``client`` is a producer on the same database.
Conftests import both fixtures to register them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import redis
from sqlalchemy import text

from producer.client import Client
from store import telemetry
from store.checkpoints import PostgresCheckpointStore
from store.leases import Heartbeat, LeaseManager
from store.settings import Settings
from store.signals import RedisSignals
from worker.agents import Agent
from worker.steps import Outcome, StepDeps, run_step


def postgres(store: object) -> PostgresCheckpointStore:
    """``store`` as the Postgres store it is in these tests (for the methods the ports leave out)."""
    assert isinstance(store, PostgresCheckpointStore)
    return store


def no_enqueue(
    session_id: str, seq: int | None, countdown: float = 0.0, agent: str | None = None, /, *, name: str | None = None
) -> None:
    """An enqueue that sends nothing: a ``Driver`` takes the steps itself (it replaces this once built)."""


@dataclass
class Driver:
    """Runs steps in this process, delivering the messages steps enqueue, until the run settles."""

    deps: StepDeps
    queue: list[tuple[str, int | None]] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    countdowns: list[float] = field(default_factory=list)
    #: What each step did (``store.telemetry``), in delivery order.
    reports: list[telemetry.StepReport] = field(default_factory=list)

    def enqueue(
        self,
        session_id: str,
        seq: int | None,
        countdown: float = 0.0,
        agent: str | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self.queue.append((session_id, seq))
        self.countdowns.append(countdown)

    def step(self, session_id: str | None = None) -> Outcome:
        """Deliver one message: the oldest queued, or a fresh one for ``session_id``, with its report as a task has."""
        message = self.queue.pop(0) if self.queue else (session_id or "", None)
        with telemetry.step(*message) as report:
            outcome = run_step(self.deps, *message)
            report.outcome = outcome.value
        self.outcomes.append(outcome)
        self.reports.append(report)
        return outcome

    def drain(self, session_id: str | None = None, limit: int = 200) -> list[Outcome]:
        """Deliver messages (countdowns are not waited for) until none is left."""
        if session_id is not None:
            self.queue.append((session_id, None))
        done: list[Outcome] = []
        while self.queue and len(done) < limit:
            done.append(self.step())
        return done


@pytest.fixture
def make_driver(
    store: PostgresCheckpointStore, leases: LeaseManager, redis_client: redis.Redis, settings: Settings
) -> Iterator[Callable[..., Driver]]:
    """``make_driver(*agents, max_attempts=5)``: an in-process step driver on the real services."""
    heartbeats: list[Heartbeat] = []

    def make(*agents: Agent, max_attempts: int = 5) -> Driver:
        heartbeat = Heartbeat(leases, settings.lease_renew_ms)
        heartbeats.append(heartbeat)
        driver = Driver(
            StepDeps(
                store=store,
                leases=leases,
                heartbeat=heartbeat,
                agents={a.name: a for a in agents},
                enqueue=no_enqueue,
                max_attempts=max_attempts,
                signals=RedisSignals(redis_client),
            )
        )
        driver.deps.enqueue = driver.enqueue
        store.register_agents({a.name: a.fingerprint() for a in agents})
        return driver

    yield make
    for heartbeat in heartbeats:
        heartbeat.stop()


@pytest.fixture
def client(settings: Settings, store: PostgresCheckpointStore) -> Iterator[Client]:
    """A producer client on the test services (its enqueued messages are never consumed here)."""
    with Client(settings, engine=store.engine) as made:
        yield made


@dataclass
class Sent:
    """What the sweep enqueued: (session_id, seq, countdown, agent)."""

    messages: list[tuple[str, int | None, float, str | None]] = field(default_factory=list)

    def __call__(
        self,
        session_id: str,
        seq: int | None,
        countdown: float = 0.0,
        agent: str | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self.messages.append((session_id, seq, countdown, agent))

    @property
    def session_ids(self) -> set[str]:
        return {m[0] for m in self.messages}


def paused_row(store: PostgresCheckpointStore, session_id: str, *, expired: bool = False) -> tuple[str, str]:
    """A run row paused on one approval, written directly (``expired``: it expired a second ago); its ids."""
    approval_id = f"ap-{session_id}"
    with store.engine.begin() as conn:
        conn.execute(
            text("""INSERT INTO runs (session_id, agent, status, document)
                             VALUES (:sid, 'desk', 'awaiting-approval', CAST(:doc AS jsonb))"""),
            {"sid": session_id, "doc": f'{{"approval_ids": ["{approval_id}"]}}'},
        )
        conn.execute(
            text("""INSERT INTO approvals (approval_id, session_id, tool_call_id, tool_name, args, agent,
                                                    expires_at)
                             VALUES (:ap, :sid, 'call_0_0', 'refund', '{}', 'desk',
                                     CASE WHEN :expired THEN now() - interval '1 second' END)"""),
            {"ap": approval_id, "sid": session_id, "expired": expired},
        )
    return session_id, approval_id
