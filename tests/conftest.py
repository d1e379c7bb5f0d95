"""Shared fixtures: the real services for integration and crash tests, skipped locally when absent.

In CI (``CI`` set) a missing service fails the run instead of skipping it.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator

import pytest
import redis

from store.checkpoints import PostgresCheckpointStore
from store.database import make_engine
from store.leases import LeaseManager
from store.settings import Settings
from tests.support import reports, services

#: Fixtures of one feature's tests (the tests are in folders by tier, each feature's in files named for it).
pytest_plugins = [
    "tests.support.cli_fixtures",
    "tests.support.http_fixtures",
    "tests.support.provider_fixtures",
    "tests.support.schedule_fixtures",
    "tests.support.ui_fixtures",
]

_SERVICE_MARKERS = ("integration", "crash")
_prepared: dict[str, str | None] = {}


def _needs_services(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(m) for m in _SERVICE_MARKERS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = str(item.fspath)
        if f"{os.sep}integration{os.sep}" in path:
            item.add_marker(pytest.mark.integration)
        if f"{os.sep}crash{os.sep}" in path:
            item.add_marker(pytest.mark.crash)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep whether the test's call failed (``tests.support.reports``): fixtures keep their logs only then."""
    report = yield
    if report.when == "call":
        item.stash[reports.FAILED] = report.failed
    return report


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not _needs_services(item):
        return
    if "ready" not in _prepared:
        problem = services.services_available()
        if problem is None:
            services.recreate_database()
        _prepared["ready"] = problem
    problem = _prepared["ready"]
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)
    services.reset_state()


@pytest.fixture
def settings() -> Settings:
    """Settings pointing at the test database and Redis db, with CI timing."""
    return services.test_settings()


@pytest.fixture
def store(settings: Settings) -> Iterator[PostgresCheckpointStore]:
    """A checkpoint store on the test database."""
    engine = make_engine(settings)
    yield PostgresCheckpointStore(engine, settings.history_limit)
    engine.dispose()


@pytest.fixture
def redis_client(settings: Settings) -> Iterator[redis.Redis]:
    """A client of the test Redis db."""
    client = redis.Redis.from_url(settings.redis_url)
    yield client
    client.close()


@pytest.fixture
def leases(redis_client: redis.Redis, settings: Settings) -> LeaseManager:
    """Lease manager on the test Redis db with the test TTL."""
    return LeaseManager(redis_client, settings.lease_ttl_ms)
