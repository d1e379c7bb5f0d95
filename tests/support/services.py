"""Test access to the real Postgres and Redis: a throwaway database and Redis db per test session."""

from __future__ import annotations

import os
import re
import time

import psycopg
import redis
from psycopg import sql
from sqlalchemy import Engine, text

from store.database import migrate
from store.settings import Settings

SERVER_URL = os.environ.get("LOUSHO_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("LOUSHO_REDIS_URL", "redis://127.0.0.1:6379/0")
TEST_DATABASE = os.environ.get("LOUSHO_TEST_DATABASE", "lousho_test")
TEST_REDIS_DB = int(os.environ.get("LOUSHO_TEST_REDIS_DB", "14"))


def _with_database(url: str, name: str) -> str:
    base, _, query = url.partition("?")
    base = re.sub(r"/[^/]*$", f"/{name}", base) if base.count("/") >= 3 else f"{base}/{name}"
    return f"{base}?{query}" if query else base


def _with_redis_db(url: str, db: int) -> str:
    base, _, query = url.partition("?")
    base = re.sub(r"/\d*$", "", base)
    return f"{base}/{db}" + (f"?{query}" if query else "")


def test_database_url() -> str:
    """URL of the database the tests own (created fresh once per session)."""
    return _with_database(SERVER_URL, TEST_DATABASE)


def redis_url_with_db(db: int) -> str:
    """The URL of database ``db`` on the Redis server the tests use (the machine's, or the embedded one)."""
    return _with_redis_db(REDIS_URL, db)


def test_redis_url() -> str:
    """URL of the Redis database the tests own (flushed per test)."""
    return _with_redis_db(REDIS_URL, TEST_REDIS_DB)


def services_available() -> str | None:
    """None when both services answer, else why not."""
    try:
        with psycopg.connect(SERVER_URL.replace("postgresql+psycopg://", "postgresql://"), connect_timeout=3):
            pass
    except psycopg.Error as exc:
        return f"Postgres not reachable at {SERVER_URL}: {type(exc).__name__}"
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        return f"Redis not reachable at {REDIS_URL}: {type(exc).__name__}"
    return None


def recreate_database() -> None:
    """Drop and create the test database, then migrate it."""
    admin = SERVER_URL.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{TEST_DATABASE}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{TEST_DATABASE}"')
    migrate(test_settings())


def test_settings(**overrides: object) -> Settings:
    """Settings for tests: the test database and Redis db, CI timing (TTL 2 s, sweep 1 s)."""
    values: dict[str, object] = {
        "database_url": test_database_url(),
        "redis_url": test_redis_url(),
        "lease_ttl_ms": 2000,
        "lease_renew_ms": 500,
        "recover_interval_s": 1.0,
        "history_limit": 10_000,
        "step_soft_time_limit_s": 8.0,
        "step_time_limit_s": 10.0,
        "visibility_timeout_s": 30,
        "schedule_interval_s": 1.0,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


def test_environment(**overrides: object) -> dict[str, str]:
    """Environment variables that make a subprocess (worker, beat, CLI) use the test services."""
    settings = test_settings(**overrides)
    env = {
        "LOUSHO_DATABASE_URL": settings.database_url,
        "LOUSHO_REDIS_URL": settings.redis_url,
        "LOUSHO_LEASE_TTL_MS": str(settings.lease_ttl_ms),
        "LOUSHO_LEASE_RENEW_MS": str(settings.lease_renew_ms),
        "LOUSHO_RECOVER_INTERVAL_S": str(settings.recover_interval_s),
        "LOUSHO_HISTORY_LIMIT": str(settings.history_limit),
        "LOUSHO_STEP_SOFT_TIME_LIMIT_S": str(settings.step_soft_time_limit_s),
        "LOUSHO_STEP_TIME_LIMIT_S": str(settings.step_time_limit_s),
        "LOUSHO_VISIBILITY_TIMEOUT_S": str(settings.visibility_timeout_s),
        "LOUSHO_SCHEDULE_INTERVAL_S": str(settings.schedule_interval_s),
    }
    return env


def reset_state() -> None:
    """Empty every table and the test Redis db."""
    with psycopg.connect(test_database_url(), autocommit=True) as conn:
        conn.execute(
            "TRUNCATE runs, run_messages, run_events, checkpoint_history, inbox, agents, agent_workers,"
            " doctor_runs, doctor_looks,"
            " sends, approvals, deliveries, delivery_bodies, schedules, schedule_fires, lead_news"
        )
    redis.Redis.from_url(test_redis_url()).flushdb()


def own_database(settings: Settings, name: str) -> Settings:
    """``settings`` on an empty database ``name`` of the test server (dropped first if it exists)."""
    drop_database(name)
    with psycopg.connect(SERVER_URL.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return settings.model_copy(update={"database_url": _with_database(SERVER_URL, name)})


def drop_database(name: str) -> None:
    """Drop database ``name`` of the test server (``own_database``'s), whoever is connected to it."""
    admin = SERVER_URL.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def wait_for_lock_waiter(engine: Engine, what: str, timeout_s: float = 10.0) -> None:
    """Until another connection of this database waits on a row lock (a statement blocked by ours)."""
    deadline = time.monotonic() + timeout_s
    with engine.connect() as conn:
        while not conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        ).scalar():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what} to wait on a lock")
            conn.rollback()
            time.sleep(0.02)
