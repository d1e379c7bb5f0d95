"""Integration fixtures: the real step executor on the real services, driven in-process."""

from __future__ import annotations

import pytest
import redis

from tests.support.driver import Driver, client, make_driver  # noqa: F401  # fixtures for the tests here


@pytest.fixture
def raw_redis(redis_client: redis.Redis) -> redis.Redis:
    return redis_client
