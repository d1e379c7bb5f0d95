"""Steps whose process died on this host are sent again at once (``worker.orphans``): by the worker's main process
when a pool process dies mid-step, and at start for the leases a worker killed whole left behind."""

from __future__ import annotations

from store.inputs import normalize_input
from store.memory import MemoryCheckpointStore, MemoryLeaseManager
from store.records import DueRun
from tests.fakes import processes
from tests.fakes.clock import FakeClock
from worker import orphans

TTL_MS = 30_000


def _step(task_id: str, pid: int, session_id: str) -> orphans.PoolStep:
    return orphans.PoolStep(task_id, pid, session_id, "lousho.shop", "shop: tool batch")


def test_the_step_of_a_pool_process_that_died_is_sent_again_once_with_its_lease_released() -> None:
    # Given a pool process that died holding the lease of run-1, and a live one holding run-2's
    clock = FakeClock()
    leases = MemoryLeaseManager(TTL_MS, clock)
    store = MemoryCheckpointStore(clock=clock)
    for sid in ("run-1", "run-2"):
        store.append_input(sid, "shop", normalize_input("go"))
    clock.advance(ms=TTL_MS + 1)
    sent: list[orphans.PoolStep] = []
    watch = orphans.DeadSteps(leases, sent.append, store)
    dead_owner = processes.exited_owner()
    dead_pid = int(dead_owner.split(":")[1])
    leases.hold_as("run-1", dead_owner)
    with processes.running() as live:
        leases.hold_as("run-2", processes.owner_of(live.pid))
        steps = [_step("t1", dead_pid, "run-1"), _step("t2", live.pid, "run-2")]
        # When the main process checks its pool's steps, twice (Celery lists the dead step until it notices)
        first = watch.check(steps)
        again = watch.check(steps)
    # Then the dead process's step went out once, as it came, and its lease is free for it
    assert first == ["run-1"] and again == []
    assert sent == [steps[0]]
    assert leases.holder("run-1") is None and leases.holder("run-2") is not None
    # And the run is marked as the sweep marks the runs it sends: not sent again for a while, its recovery reported
    assert [run.session_id for run in store.due_runs(TTL_MS / 1000)] == ["run-2"]


def test_a_pool_process_that_died_before_its_parent_knew_its_step_is_noticed_by_its_absence() -> None:
    # Given a step message no process is known to run yet, whose lease a pool process took
    leases = MemoryLeaseManager(TTL_MS, FakeClock())
    sent: list[orphans.PoolStep] = []
    watch = orphans.DeadSteps(leases, sent.append)
    step = orphans.PoolStep("t1", None, "run-1")
    with processes.running() as child:
        leases.hold_as("run-1", processes.owner_of(child.pid))
        # While the pool's processes all run, nothing is sent
        assert watch.check([step], [child.pid]) == []
        assert watch.check([step], [child.pid]) == []
    # When that process is gone at the next check (its parent reaped it), then the step it held goes out again
    assert watch.check([step], [child.pid]) == ["run-1"]
    assert sent == [step] and leases.holder("run-1") is None
    assert watch.check([step], []) == []


def test_a_replaced_pool_process_counts_as_a_death_even_when_no_check_saw_it_dead() -> None:
    # Given a step whose process died and was replaced between two checks, before its parent knew it ran the step
    leases = MemoryLeaseManager(TTL_MS, FakeClock())
    sent: list[orphans.PoolStep] = []
    watch = orphans.DeadSteps(leases, sent.append)
    step = orphans.PoolStep("t1", None, "run-1")
    with processes.running() as old, processes.running() as replacement:
        assert watch.check([step], [old.pid]) == []  # the first check: nothing held by a gone process yet
        leases.hold_as("run-1", processes.exited_owner())
        # When the next check finds another process in the pool, then the step is sent again
        assert watch.check([step], [old.pid, replacement.pid]) == ["run-1"]
    assert sent == [step]


def test_a_step_whose_request_celery_dropped_before_the_check_is_still_sent_again() -> None:
    # Given a step a pool process ran, seen at one check, whose request Celery dropped (and requeued a stale copy of)
    # when it noticed the process die, before the next check
    leases = MemoryLeaseManager(TTL_MS, FakeClock())
    sent: list[orphans.PoolStep] = []
    watch = orphans.DeadSteps(leases, sent.append)
    with processes.running() as child, processes.running() as replacement:
        owner = processes.owner_of(child.pid)
        step = _step("t1", child.pid, "run-1")
        assert watch.check([], [child.pid]) == []  # the first check
        leases.hold_as("run-1", owner)
        assert watch.check([step], [child.pid]) == []  # it runs
        child.kill()
        child.wait(5)
        # When the next check no longer lists the step, but the pool lost that process
        sent_now = watch.check([], [replacement.pid])
    # Then the step still goes out, once, its dead holder's lease released
    assert sent_now == ["run-1"] and sent == [step] and leases.holder("run-1") is None
    assert watch.check([], [replacement.pid]) == []


def test_a_dead_step_whose_run_another_process_holds_now_is_not_sent_again() -> None:
    # Given Celery's own redelivery got there first: a live process of this host holds the run now
    leases = MemoryLeaseManager(TTL_MS, FakeClock())
    sent: list[orphans.PoolStep] = []
    dead_pid = int(processes.exited_owner().split(":")[1])
    taken = leases.acquire("run-1")
    assert taken is not None
    # When the dead process's step is checked, then nothing is released nor sent
    assert orphans.DeadSteps(leases, sent.append).check([_step("t1", dead_pid, "run-1")]) == []
    assert sent == [] and leases.holder("run-1") == taken.owner


def test_at_start_the_runs_whose_leases_dead_processes_of_this_host_hold_are_sent_again() -> None:
    # Given three runs with work: one held by a process that died, one by a live process, one by nobody
    clock = FakeClock()
    store = MemoryCheckpointStore(clock=clock)
    leases = MemoryLeaseManager(TTL_MS, clock)
    for sid in ("held-dead", "held-live", "free"):
        store.append_input(sid, "shop", normalize_input("go"))
    clock.advance(ms=2000)
    leases.hold_as("held-dead", processes.exited_owner())
    sent: list[DueRun] = []
    with processes.running() as live:
        leases.hold_as("held-live", processes.owner_of(live.pid))
        # When a restarted worker looks, reading one run per page
        count = orphans.resend_at_start(store, leases, sent.append, page_size=1)
    # Then only the dead holder's run is sent (the free one is the sweep's, the live one its holder's), and swept
    assert count == 1 and [run.session_id for run in sent] == ["held-dead"]
    assert leases.holder("held-dead") is None and leases.holder("held-live") is not None
    assert {run.session_id for run in store.due_runs(1.0)} == {"held-live", "free"}


def test_a_step_received_but_never_listed_at_a_check_is_sent_again_when_its_process_dies() -> None:
    # Given a step message the worker received, whose pool process took its lease and died before any check listed
    # it (Celery dropped the request at once)
    leases = MemoryLeaseManager(TTL_MS, FakeClock())
    sent: list[orphans.PoolStep] = []
    watch = orphans.DeadSteps(leases, sent.append)
    with processes.running() as child, processes.running() as replacement:
        assert watch.check([], [child.pid]) == []  # the first check
        step = orphans.PoolStep("t1", None, "run-1")
        watch.received(step)
        leases.hold_as("run-1", processes.owner_of(child.pid))
        child.kill()
        child.wait(5)
        # When the next check finds the pool changed, then the received step goes out
        assert watch.check([], [replacement.pid]) == ["run-1"]
    assert sent == [step] and leases.holder("run-1") is None
