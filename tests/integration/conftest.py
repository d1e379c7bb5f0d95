"""Integration fixtures: the real step executor on the real services, driven in-process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from store.settings import Settings
from tests.support.driver import Driver, Sent, client, make_driver  # noqa: F401  # fixtures for the tests here
from worker import tasks


@pytest.fixture
def raw_redis(redis_client: redis.Redis) -> redis.Redis:
    return redis_client


@pytest.fixture
def sent(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sent]:
    """``tasks.recover`` on the test database, its messages collected instead of published."""
    recorder = Sent()
    monkeypatch.setattr(tasks, "settings", settings)
    monkeypatch.setattr(tasks, "enqueue", recorder)
    monkeypatch.setitem(tasks._state, "pid", None)
    monkeypatch.setitem(tasks._state, "deps", None)
    yield recorder
    built = tasks._state.get("deps")
    if built is not None:
        built.heartbeat.stop()
        built.store.engine.dispose()
