"""The store and lease contracts of the unit tier, run against the real Postgres and Redis."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import datetime

import psycopg
import pytest
import redis
from sqlalchemy import Engine

from store import keys
from store.approvals import PostgresApprovalStore
from store.checkpoints import PostgresCheckpointStore
from store.leases import LeaseManager
from store.model_slots import RedisModelSlots
from store.settings import Settings
from tests.fakes import lease_contract, slot_contract, store_contract
from tests.support import services


def _now() -> datetime:
    with psycopg.connect(services.test_database_url()) as conn:
        value = conn.execute("SELECT now()").fetchone()
    assert value is not None
    moment: datetime = value[0]
    return moment


def _corrupt(session_id: str) -> None:
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        conn.execute("""UPDATE runs SET document = '{"messages": 7}' WHERE session_id = %s""", (session_id,))


@pytest.fixture
def postgres_subjects(store: PostgresCheckpointStore) -> Iterator[store_contract.StoreFactory]:
    engine: Engine = store.engine

    def make(history_limit: int) -> store_contract.StoreSubject:
        services.reset_state()
        return store_contract.StoreSubject(
            store=PostgresCheckpointStore(engine, history_limit),
            approvals=PostgresApprovalStore(engine),
            now=_now,
            tick=lambda: time.sleep(0.01),
            corrupt=_corrupt,
        )

    yield make


@pytest.mark.parametrize("check", store_contract.CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_postgres_keeps_the_store_contract(
    check: Callable[[store_contract.StoreFactory], None], postgres_subjects: store_contract.StoreFactory
) -> None:
    check(postgres_subjects)


@pytest.fixture
def redis_subjects(settings: Settings) -> Iterator[lease_contract.LeaseFactory]:
    clients: list[redis.Redis] = []

    def make() -> lease_contract.LeaseSubject:
        client = redis.Redis.from_url(settings.redis_url)
        clients.append(client)
        client.flushdb()
        return lease_contract.LeaseSubject(
            leases=LeaseManager(client, settings.lease_ttl_ms),
            expire=lambda sid: client.delete(keys.lease_key(sid)),
            lose_everything=client.flushdb,
            hold_as=lambda sid, owner: client.set(keys.lease_key(sid), owner, px=settings.lease_ttl_ms),
        )

    yield make
    for client in clients:
        client.close()


@pytest.mark.parametrize("check", lease_contract.CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_redis_keeps_the_lease_contract(
    check: Callable[[lease_contract.LeaseFactory], None], redis_subjects: lease_contract.LeaseFactory
) -> None:
    check(redis_subjects)


@pytest.fixture
def redis_slot_subjects(settings: Settings) -> Iterator[slot_contract.SlotFactory]:
    clients: list[redis.Redis] = []

    def make() -> slot_contract.SlotSubject:
        client = redis.Redis.from_url(settings.redis_url)
        clients.append(client)
        client.flushdb()
        return slot_contract.SlotSubject(
            slots=RedisModelSlots(client, slot_contract.TTL_MS), elapse=time.sleep, lose_everything=client.flushdb
        )

    yield make
    for client in clients:
        client.close()


@pytest.mark.parametrize("check", slot_contract.CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_redis_keeps_the_model_slot_contract(
    check: Callable[[slot_contract.SlotFactory], None], redis_slot_subjects: slot_contract.SlotFactory
) -> None:
    check(redis_slot_subjects)
