"""The run-lease contract: checks every implementation of ``store.interfaces.Leases`` must pass, given a factory.

The unit tier runs them against ``LeaseManager`` over fakeredis (with Lua) and against
``store.memory.MemoryLeaseManager``; the integration tier runs them against real Redis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from store import errors, interfaces, owners
from store.records import Lease
from tests.fakes import processes


@dataclass
class LeaseSubject:
    """Leases under test, and the two things that happen to them from outside."""

    leases: interfaces.Leases
    #: The lease on a run times out (its holder stalled past the TTL).
    expire: Callable[[str], object]
    #: The lease service loses every key, fencing counters included (a restart without persistence).
    lose_everything: Callable[[], object]
    #: Another process holds the lease on a run under this owner id (it wrote the key itself).
    hold_as: Callable[[str, str], object]


LeaseFactory = Callable[[], LeaseSubject]


def _take(leases: interfaces.Leases, session_id: str, floor: int = 0) -> Lease:
    lease = leases.acquire(session_id, floor)
    assert lease is not None, f"lease on {session_id} not granted"
    return lease


def check_a_lease_is_exclusive_until_released(make: LeaseFactory) -> None:
    leases = make().leases
    first = _take(leases, "lc-exclusive")
    assert first.token >= 1
    assert leases.acquire("lc-exclusive") is None
    assert leases.holder("lc-exclusive") == first.owner
    assert leases.held(["lc-exclusive", "lc-nobody"]) == {"lc-exclusive"}
    assert leases.release(first) is True
    assert leases.holder("lc-exclusive") is None and leases.held(["lc-exclusive"]) == set()
    assert leases.held([]) == set()


def check_tokens_strictly_increase_across_holders(make: LeaseFactory) -> None:
    subject = make()
    leases = subject.leases
    tokens = []
    for round_ in range(3):
        lease = _take(leases, "lc-tokens")
        tokens.append(lease.token)
        if round_ % 2:
            subject.expire("lc-tokens")
        else:
            leases.release(lease)
    assert tokens == sorted(set(tokens)) and len(tokens) == 3
    assert _take(leases, "lc-tokens-other").token >= 1  # counters are per run


def check_a_floor_is_respected(make: LeaseFactory) -> None:
    leases = make().leases
    high = _take(leases, "lc-floor", floor=100)
    assert high.token > 100
    leases.release(high)
    assert _take(leases, "lc-floor", floor=5).token > high.token


def check_an_expired_lease_goes_to_the_next_taker(make: LeaseFactory) -> None:
    subject = make()
    old = _take(subject.leases, "lc-expire")
    subject.expire("lc-expire")
    new = _take(subject.leases, "lc-expire")
    assert new.token > old.token and subject.leases.holder("lc-expire") == new.owner


def check_only_the_owner_renews(make: LeaseFactory) -> None:
    subject = make()
    leases = subject.leases
    old = _take(leases, "lc-renew")
    assert leases.renew(old) is True and not old.lost.is_set()
    subject.expire("lc-renew")
    new = _take(leases, "lc-renew")
    assert leases.renew(old) is False and old.lost.is_set()
    assert leases.renew(new) is True and not new.lost.is_set()
    assert leases.holder("lc-renew") == new.owner


def check_renew_many_marks_only_the_lost_leases(make: LeaseFactory) -> None:
    subject = make()
    leases = subject.leases
    kept = _take(leases, "lc-many-kept")
    lost = _take(leases, "lc-many-lost")
    subject.expire("lc-many-lost")
    _take(leases, "lc-many-lost")
    leases.renew_many([kept, lost])
    assert not kept.lost.is_set() and lost.lost.is_set()
    leases.renew_many([])


def check_only_the_owner_releases(make: LeaseFactory) -> None:
    subject = make()
    leases = subject.leases
    old = _take(leases, "lc-release")
    subject.expire("lc-release")
    new = _take(leases, "lc-release")
    assert leases.release(old) is False
    assert leases.holder("lc-release") == new.owner
    assert leases.release(new) is True and leases.holder("lc-release") is None
    assert leases.release(new) is False


def check_only_the_owner_raises_its_token(make: LeaseFactory) -> None:
    subject = make()
    leases = subject.leases
    lease = _take(leases, "lc-raise")
    assert leases.raise_token(lease, 50) is True and lease.token > 50
    raised = lease.token
    subject.expire("lc-raise")
    assert leases.raise_token(lease, 500) is False and lease.token == raised
    assert _take(leases, "lc-raise").token > raised


def check_losing_every_key_restarts_tokens_and_a_floor_lifts_them(make: LeaseFactory) -> None:
    subject = make()
    leases = subject.leases
    before = _take(leases, "lc-lost")
    leases.release(before)
    before = _take(leases, "lc-lost")
    subject.lose_everything()
    assert leases.holder("lc-lost") is None
    after = _take(leases, "lc-lost")
    assert after.token == 1  # the counter restarted: only the store's fence knows better
    assert leases.raise_token(after, before.token) is True and after.token > before.token


def check_invalid_run_ids_are_refused_before_any_key_is_touched(make: LeaseFactory) -> None:
    leases = make().leases
    for bad in ("", "has space", ".edge", "x" * 201, "run.paused", "'; DROP"):
        with pytest.raises(errors.SessionIdInvalidError):
            leases.acquire(bad)
        with pytest.raises(errors.SessionIdInvalidError):
            leases.holder(bad)


def _held_by(subject: LeaseSubject, session_id: str, owner: str) -> int:
    """Hold the run's lease under ``owner`` after a lease of our own took a token; that token."""
    first = _take(subject.leases, session_id)
    subject.expire(session_id)
    subject.hold_as(session_id, owner)
    assert subject.leases.holder(session_id) == owner
    return first.token


def check_a_lease_whose_holder_exited_on_this_host_is_taken_over_at_once(make: LeaseFactory) -> None:
    subject = make()
    before = _held_by(subject, "lc-exited", processes.exited_owner())
    taken = subject.leases.acquire("lc-exited")
    assert taken is not None, "the lease of an exited process was not taken over"
    assert taken.token > before and subject.leases.holder("lc-exited") == taken.owner
    assert subject.leases.acquire("lc-exited") is None  # the new holder is this live process


def check_a_live_holder_or_one_of_another_host_is_never_taken_over_early(make: LeaseFactory) -> None:
    subject = make()
    me = owners.this_process()
    dead = processes.exited_owner()
    with processes.running() as process:
        kept = {
            "live": processes.owner_of(process.pid),
            "this process": owners.new_owner(),
            "another host": processes.owner_of(process.pid, host=me.host + "-other", start=0),
            "another boot": dead.replace(me.boot, "0" * len(me.boot)),
            "another PID namespace": dead.replace(f":{me.pidns}:", ":1:"),
            "an older release": f"{me.host}:{dead.split(':')[1]}:0123456789ab",
            "unreadable": "somewhere",
        }
        for what, owner in kept.items():
            sid = "lc-kept-" + what.replace(" ", "-")
            _held_by(subject, sid, owner)
            assert subject.leases.acquire(sid) is None, f"a lease held by {what} ({owner}) was taken early"
            assert subject.leases.holder(sid) == owner


def check_a_reused_pid_is_not_mistaken_for_the_holder(make: LeaseFactory) -> None:
    subject = make()
    with processes.running() as process:
        # The holder had this PID but started at another time: the PID now names another process.
        reused = processes.owner_of(process.pid, start=(owners.process_start(process.pid) or 0) + 1)
        before = _held_by(subject, "lc-reused", reused)
        taken = subject.leases.acquire("lc-reused")
        assert taken is not None, "a PID reused by a new process was mistaken for the holder"
        assert taken.token > before


def check_only_the_leases_of_gone_holders_are_released(make: LeaseFactory) -> None:
    subject = make()
    leases = subject.leases
    _held_by(subject, "lc-gone", processes.exited_owner())
    mine = _take(leases, "lc-mine")
    with processes.running() as process:
        live = processes.owner_of(process.pid)
        _held_by(subject, "lc-live", live)
        assert leases.release_gone(["lc-gone", "lc-mine", "lc-live", "lc-free"]) == ["lc-gone"]
        assert leases.holder("lc-gone") is None
        assert leases.holder("lc-mine") == mine.owner and leases.holder("lc-live") == live
    assert leases.release_gone([]) == []


CHECKS: tuple[Callable[[LeaseFactory], None], ...] = (
    check_a_lease_is_exclusive_until_released,
    check_tokens_strictly_increase_across_holders,
    check_a_floor_is_respected,
    check_an_expired_lease_goes_to_the_next_taker,
    check_only_the_owner_renews,
    check_renew_many_marks_only_the_lost_leases,
    check_only_the_owner_releases,
    check_only_the_owner_raises_its_token,
    check_losing_every_key_restarts_tokens_and_a_floor_lifts_them,
    check_invalid_run_ids_are_refused_before_any_key_is_touched,
    check_a_lease_whose_holder_exited_on_this_host_is_taken_over_at_once,
    check_a_live_holder_or_one_of_another_host_is_never_taken_over_early,
    check_a_reused_pid_is_not_mistaken_for_the_holder,
    check_only_the_leases_of_gone_holders_are_released,
)
