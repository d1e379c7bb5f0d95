"""The in-memory checkpoint store held to the store contract, plus what only a fake clock can show."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import timedelta

import pytest

from store.approvals import PostgresApprovalStore
from store.checkpoints import PostgresCheckpointStore
from store.leases import LeaseManager
from store.memory import MemoryApprovalStore, MemoryCheckpointStore, MemoryLeaseManager
from store.records import LastError, Message
from tests.fakes import store_contract
from tests.fakes.clock import FakeClock


def _memory_subject(history_limit: int) -> store_contract.StoreSubject:
    clock = FakeClock()
    store = MemoryCheckpointStore(history_limit=history_limit, clock=clock)
    return store_contract.StoreSubject(
        store=store,
        approvals=MemoryApprovalStore(store),
        now=clock,
        tick=lambda: clock.advance(ms=1),
        corrupt=lambda sid: store.overwrite_document(sid, {"messages": "not a list"}),
    )


@pytest.mark.parametrize("check", store_contract.CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_memory_store_keeps_the_store_contract(check: Callable[[store_contract.StoreFactory], None]) -> None:
    check(_memory_subject)


def test_a_run_becomes_stale_only_once_the_threshold_has_passed() -> None:
    # Given a run created at t0
    clock = FakeClock()
    store = MemoryCheckpointStore(clock=clock)
    store.append_input("run-1", "agent", [Message(role="user", content="hi")])
    # When less than the threshold passes, then it is not stale; when more passes, it is
    clock.advance(seconds=2)
    assert store.stale_runs(2.0) == []
    clock.advance(ms=1)
    assert store.stale_runs(2.0) == [("run-1", 0)]


def test_a_recorded_failure_counts_as_activity_for_the_sweep() -> None:
    # Given a stale run
    clock = FakeClock()
    store = MemoryCheckpointStore(clock=clock)
    store.append_input("run-1", "agent", [Message(role="user", content="hi")])
    claim = store.claim("run-1", 1, None)
    assert claim.checkpoint is not None
    clock.advance(seconds=10)
    # When a step records a failure, then the run is fresh again
    store.record_failure("run-1", 1, LastError(code="X", retryable=True))
    assert store.stale_runs(5.0) == []
    clock.advance(seconds=5, ms=1)
    assert store.stale_runs(5.0) == [("run-1", 0)]


def test_save_time_and_history_time_come_from_the_injected_clock() -> None:
    clock = FakeClock()
    store = MemoryCheckpointStore(clock=clock)
    store.append_input("run-1", "agent", [Message(role="user", content="hi")])
    claim = store.claim("run-1", 1, None)
    assert claim.checkpoint is not None
    later = clock.advance(timedelta(minutes=3).total_seconds())
    assert store.save(claim.checkpoint.model_copy(update={"seq": 1})) == later
    (entry,) = store.history("run-1")
    assert entry.saved_at == later


@pytest.mark.parametrize(
    ("real", "fake"),
    [
        (PostgresCheckpointStore, MemoryCheckpointStore),
        (PostgresApprovalStore, MemoryApprovalStore),
        (LeaseManager, MemoryLeaseManager),
    ],
    ids=["checkpoints", "approvals", "leases"],
)
def test_the_fakes_offer_every_public_method_of_the_real_stores_with_the_same_parameters(
    real: type, fake: type
) -> None:
    # When the real store grows a method, the fake must follow, or the unit tier silently drifts.
    for name, method in inspect.getmembers(real, inspect.isfunction):
        if name.startswith("_"):
            continue
        assert hasattr(fake, name), f"{fake.__name__} lacks {name}"
        expected = [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]
        actual = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(fake, name)).parameters.values()]
        assert actual == expected, f"{fake.__name__}.{name} parameters differ"
