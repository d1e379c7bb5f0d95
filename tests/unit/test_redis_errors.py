"""Redis failures leave the store as ``StorageError``: callers in worker and producer never see redis-py's errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from store import broker, errors, redis_client
from store.leases import LeaseManager
from store.records import Lease
from store.signals import RedisSignals

#: Nothing listens here: every command fails to connect at once.
_UNREACHABLE = "redis://127.0.0.1:1/0"


def _client() -> redis.Redis:
    return redis.Redis.from_url(_UNREACHABLE, socket_connect_timeout=0.2, socket_timeout=0.2)


def test_lease_calls_raise_storage_error_with_the_redis_error_as_cause() -> None:
    leases = LeaseManager(_client(), ttl_ms=1000)
    lease = Lease("r-1", "owner", 1)
    calls: list[Callable[[], object]] = [
        lambda: leases.acquire("r-1"),
        lambda: leases.renew(lease),
        lambda: leases.release(lease),
        lambda: leases.holder("r-1"),
        lambda: leases.held(["r-1"]),
        lambda: leases.release_gone(["r-1"]),
        lambda: leases.renew_many([lease]),
        lambda: leases.raise_token(lease, 3),
    ]
    for call in calls:
        with pytest.raises(errors.StorageError) as raised:
            call()
        assert isinstance(raised.value.__cause__, redis.RedisError)
        assert raised.value.code == "LOUSHO_STORAGE_FAILED"


def test_signals_that_callers_check_raise_storage_error_and_best_effort_ones_stay_quiet() -> None:
    signals = RedisSignals(_client())
    for call in (
        lambda: signals.watch("r-1", 100),
        lambda: signals.ring_abort("r-1"),
        lambda: signals.mark_steer("r-1", 2),
        lambda: signals.subscribe("r-1"),
    ):
        with pytest.raises(errors.StorageError):
            call()
    signals.publish("r-1", "{}")
    signals.clear_abort("r-1")
    signals.clear_steer("r-1")


def test_the_broker_scan_raises_storage_error() -> None:
    with pytest.raises(errors.StorageError):
        broker.scan(_client(), ["lousho"])


def test_translated_keeps_other_errors_and_results() -> None:
    @redis_client.translated
    def fails(kind: type[Exception]) -> None:
        raise kind("boom")

    with pytest.raises(ValueError):
        fails(ValueError)
    with pytest.raises(errors.StorageError):
        fails(redis.ConnectionError)
    assert redis_client.translated(lambda: 7)() == 7
