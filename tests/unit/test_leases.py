"""Run leases: the lease contract on ``LeaseManager`` over fakeredis (Lua scripts) and on the
in-memory fake, then what only a fake clock can show (expiry to the millisecond, renewals)."""

from __future__ import annotations

from collections.abc import Callable

import fakeredis
import pytest

from store import keys
from store.leases import LeaseManager
from store.memory import MemoryLeaseManager
from tests.fakes import lease_contract
from tests.fakes.clock import FakeClock

TTL_MS = 2000


def _redis_subject() -> lease_contract.LeaseSubject:
    client = fakeredis.FakeRedis()
    return lease_contract.LeaseSubject(
        leases=LeaseManager(client, TTL_MS),
        expire=lambda sid: client.delete(keys.lease_key(sid)),
        lose_everything=client.flushall,
        hold_as=lambda sid, owner: client.set(keys.lease_key(sid), owner, px=TTL_MS),
    )


def _memory_subject() -> lease_contract.LeaseSubject:
    leases = MemoryLeaseManager(TTL_MS, FakeClock())
    return lease_contract.LeaseSubject(
        leases=leases, expire=leases.expire, lose_everything=leases.flush_all, hold_as=leases.hold_as
    )


@pytest.mark.parametrize("make", [_redis_subject, _memory_subject], ids=["redis-lua", "memory"])
@pytest.mark.parametrize("check", lease_contract.CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_leases_keep_the_lease_contract(
    check: Callable[[lease_contract.LeaseFactory], None], make: lease_contract.LeaseFactory
) -> None:
    check(make)


def test_a_memory_lease_lives_until_its_ttl_and_not_a_millisecond_longer() -> None:
    # Given a lease taken at t0
    clock = FakeClock()
    leases = MemoryLeaseManager(TTL_MS, clock)
    first = leases.acquire("run-1")
    assert first is not None
    # When exactly one TTL passes, then it is still held (Redis keeps a key up to its expiry)
    clock.advance(ms=TTL_MS)
    assert leases.acquire("run-1") is None
    # When one more millisecond passes, then another taker gets it with a higher token
    clock.advance(ms=1)
    second = leases.acquire("run-1")
    assert second is not None and second.token > first.token
    assert leases.renew(first) is False and first.lost.is_set()


def test_renewing_a_memory_lease_pushes_its_expiry_one_ttl_out() -> None:
    clock = FakeClock()
    leases = MemoryLeaseManager(TTL_MS, clock)
    lease = leases.acquire("run-1")
    assert lease is not None
    for _ in range(5):
        clock.advance(ms=TTL_MS - 1)
        assert leases.renew(lease) is True
    assert leases.holder("run-1") == lease.owner
    clock.advance(ms=TTL_MS + 1)
    assert leases.holder("run-1") is None and leases.held(["run-1"]) == set()


def test_advancing_the_clock_expires_every_unrenewed_memory_lease() -> None:
    clock = FakeClock()
    leases = MemoryLeaseManager(TTL_MS, clock)
    taken = [leases.acquire(f"run-{n}") for n in range(3)]
    assert all(taken)
    clock.advance(ms=TTL_MS + 1)
    assert leases.held([f"run-{n}" for n in range(3)]) == set()


def test_fencing_counters_expire_after_thirty_days_unused_like_the_redis_key() -> None:
    clock = FakeClock()
    leases = MemoryLeaseManager(TTL_MS, clock)
    for _ in range(3):
        lease = leases.acquire("run-1")
        assert lease is not None
        leases.release(lease)
    clock.advance(ms=keys.FENCE_EXPIRE_MS + 1)
    lease = leases.acquire("run-1")
    assert lease is not None and lease.token == 1
