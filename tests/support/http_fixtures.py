"""Webhook fixtures: the receiver on the test services, and an in-process driver that runs the steps it enqueues."""

from __future__ import annotations

import base64
import collections
from collections.abc import Iterator
from dataclasses import dataclass, field

import psycopg
import pytest
from fastapi import FastAPI
from pydantic import SecretStr
from sqlalchemy import Engine

from producer.client import Client
from producer.http import Backend, WebhookConfig, create_app, sign
from store.approvals import PostgresApprovalStore
from store.checkpoints import PostgresCheckpointStore
from store.database import make_engine
from store.deliveries import PostgresDeliveryStore
from store.leases import Heartbeat, LeaseManager
from store.settings import Settings, load_settings
from tests.support import driver as driver_support
from tests.support import services
from worker import Agent, ToolContext, tool
from worker.providers import MockModel
from worker.steps import Outcome, StepDeps, run_step

SECRET = "whsec_" + base64.b64encode(b"lousho-test-secret-0123456789abcd").decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"lousho-old-secret-0123456789abcde").decode()
API_KEY = "test-api-key-7f3c"
noted: list[str] = []


@tool
def note(text: str, ctx: ToolContext) -> str:
    """Write a note."""
    noted.append(ctx.session_id)
    return f"noted {text}"


@tool(needs_approval=True)
def refund(amount: int) -> str:
    """Refund money."""
    return f"refunded {amount}"


HOOKS = Agent(
    name="hooks",
    model=MockModel([{"tool_calls": [{"name": "note", "args": {"text": "hi"}}]}, "Done."]),
    instructions="Handle the event.",
    tools=[note],
)
DESK = Agent(
    name="desk",
    model=MockModel([{"tool_calls": [{"name": "refund", "args": {"amount": 5}}]}, "Refunded."]),
    instructions="Handle refunds.",
    tools=[refund],
)


#: The variables the receiver's configuration is built from; ``webhook_config`` unsets those it is not given.
WEBHOOK_VARIABLES = (
    "LOUSHO_WEBHOOK_SECRETS",
    "LOUSHO_GITHUB_WEBHOOK_SECRETS",
    "LOUSHO_API_KEY",
    "LOUSHO_WEBHOOK_MAX_BODY_BYTES",
    "LOUSHO_WEBHOOK_INPUT",
)


def webhook_config(**variables: str) -> WebhookConfig:
    """The configuration `lousho webhooks serve` builds when the environment holds exactly these variables."""
    with pytest.MonkeyPatch.context() as patch:
        for name in WEBHOOK_VARIABLES:
            patch.delenv(name, raising=False)
        for name, value in variables.items():
            patch.setenv(name, value)
        return WebhookConfig.from_settings(load_settings())


def key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix("whsec_"))


def signed_headers(body: bytes, delivery_id: str, timestamp: int, secret: str = SECRET) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "webhook-id": delivery_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(key(secret), delivery_id, timestamp, body),
    }


def truncate_producer_tables() -> None:
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        conn.execute("TRUNCATE deliveries, delivery_bodies, schedules, schedule_fires")


@dataclass
class Driver:
    """Runs the steps the receiver enqueues, in this process, until nothing is queued."""

    deps: StepDeps
    queue: collections.deque[tuple[str, int | None]] = field(default_factory=collections.deque)
    outcomes: list[Outcome] = field(default_factory=list)

    def enqueue(
        self,
        session_id: str,
        seq: int | None = None,
        countdown: float = 0.0,
        agent: str | None = None,
        *,
        name: str | None = None,
        kind: str | None = None,
    ) -> None:
        self.queue.append((session_id, seq))

    def drain(self, limit: int = 2000) -> None:
        while self.queue and len(self.outcomes) < limit:
            session_id, seq = self.queue.popleft()
            self.outcomes.append(run_step(self.deps, session_id, seq))


@dataclass
class Receiver:
    """The app under test with what it writes to."""

    app: FastAPI
    driver: Driver
    store: PostgresCheckpointStore
    engine: Engine
    settings: Settings


@pytest.fixture
def receiver(settings: Settings, store: PostgresCheckpointStore, leases: LeaseManager) -> Iterator[Receiver]:
    truncate_producer_tables()
    noted.clear()
    heartbeat = Heartbeat(leases, settings.lease_renew_ms)
    driver = Driver(
        StepDeps(
            store=store,
            leases=leases,
            heartbeat=heartbeat,
            agents={"hooks": HOOKS, "desk": DESK},
            enqueue=driver_support.no_enqueue,
        )
    )
    driver.deps.enqueue = driver.enqueue
    store.register_agents({a.name: a.fingerprint() for a in (HOOKS, DESK)})
    # The receiver gets a pool of its own, sized like the one `lousho webhooks serve` uses.
    engine = make_engine(settings, pool_size=8)
    client = Client(settings, engine=engine)
    backend = Backend(
        deliveries=PostgresDeliveryStore(engine),
        checkpoints=PostgresCheckpointStore(engine),
        approvals=PostgresApprovalStore(engine),
        enqueue=driver.enqueue,
        lease_holder=leases.holder,
        known_agents=client.known_agents,
    )
    config = WebhookConfig(
        secrets=(key(SECRET), key(OLD_SECRET)),
        github_secrets=(b"gh-secret",),
        api_key=SecretStr(API_KEY),
        input_pointers={"desk": "/request"},
        fairness_sources={"desk": "/tenant", "hooks": "header:x-tenant"},
    )
    app = create_app(config, backend)
    yield Receiver(app=app, driver=driver, store=store, engine=store.engine, settings=settings)
    heartbeat.stop()
    client.close()
    engine.dispose()
