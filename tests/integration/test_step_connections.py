"""A step's statements share one pooled connection; a pooled connection a server closed is replaced without a ping."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from sqlalchemy import event

from producer.client import Client
from store.checkpoints import PostgresCheckpointStore
from store.database import make_engine
from store.records import Message
from store.settings import Settings
from tests.support import services
from tests.support.driver import Driver
from worker import Agent, tool
from worker.providers import MockModel

pytestmark = pytest.mark.integration


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


def _agent() -> Agent:
    def script(messages):  # type: ignore[no-untyped-def]
        if any(m.role == "tool" for m in messages):
            return "done"
        return {"tool_calls": [{"name": "lookup", "args": {"key": "a"}}, {"name": "lookup", "args": {"key": "b"}}]}

    return Agent(name="pinned", model=MockModel(script), tools=[lookup])


def test_a_step_checks_out_one_pooled_connection(
    make_driver: Callable[..., Driver], client: Client, settings: Settings
) -> None:
    engine = make_engine(settings)
    checkouts: list[int] = []
    event.listen(engine, "checkout", lambda *_: checkouts.append(1))
    driver = make_driver(_agent())
    driver.deps.store = PostgresCheckpointStore(engine, settings.history_limit)
    client.agent("pinned").send("look things up", session_id="pin-1")
    per_step: list[int] = []
    while driver.step("pin-1").value != "idle" and len(per_step) < 10:
        per_step.append(len(checkouts))
        checkouts.clear()
    final = driver.deps.store.load("pin-1")
    engine.dispose()
    print(f"\npool checkouts per step (model turn, tool batch, final turn): {per_step}")
    assert final is not None and final.status == "finished"
    # Model turns: claim + inbox + save on one connection. The batch saves each result from its tool threads.
    assert per_step[0] == 1 and per_step[2] == 1
    assert per_step[1] <= 3


def test_a_pinned_connection_the_server_closed_is_replaced_before_its_next_statement(settings: Settings) -> None:
    engine = make_engine(settings, pool_size=1)
    store = PostgresCheckpointStore(engine, settings.history_limit)
    store.append_input("pin-2", "pinned", [Message(role="user", content="hi")])
    with store.pinned():
        claim = store.claim("pin-2", 1, None)
        assert claim.checkpoint is not None
        with psycopg.connect(services.test_database_url(), autocommit=True) as admin:
            killed = admin.execute(
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND application_name = 'lousho' AND state = 'idle'"
            ).fetchall()
        assert killed, "the pinned connection should have been idle and terminated"
        # No ping, yet the next statement of the step runs on a new connection.
        assert store.inbox("pin-2", 0)[0].messages[0].content == "hi"
        assert store.note_usage("pin-2", 1, claim.checkpoint.usage)
    engine.dispose()


def test_a_worker_store_keeps_its_steps_connection_and_still_replaces_one_the_server_closed(
    make_driver: Callable[..., Driver], client: Client, settings: Settings
) -> None:
    engine = make_engine(settings, pool_size=2)
    checkouts: list[int] = []
    event.listen(engine, "checkout", lambda *_: checkouts.append(1))
    driver = make_driver(_agent())
    store = PostgresCheckpointStore(engine, settings.history_limit, keep_connection=True)
    driver.deps.store = store
    client.agent("pinned").send("look things up", session_id="pin-3")
    first = driver.step("pin-3")
    assert first.value == "advanced" and len(checkouts) == 1
    checkouts.clear()
    with psycopg.connect(services.test_database_url(), autocommit=True) as admin:  # between two steps
        killed = admin.execute(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND application_name = 'lousho' AND state = 'idle'"
        ).fetchall()
    assert killed, "the kept connection should have been idle and terminated"
    per_step: list[int] = []
    while driver.step("pin-3").value != "idle" and len(per_step) < 10:
        per_step.append(len(checkouts))
        checkouts.clear()
    final = store.load("pin-3")
    store.close()
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    engine.dispose()
    print(f"\npool checkouts per step after the kept connection was killed (tool batch, final turn): {per_step}")
    assert final is not None and final.status == "finished"
    # The batch replaces the killed one (its tool threads check out their own); the final turn keeps it.
    assert per_step[0] <= 3 and per_step[1] == 0
