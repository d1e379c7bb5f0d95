"""Lease holders stalled with SIGSTOP at exact crash points (RELIABILITY C4 at cp1 and cp11), and the negative control.

A stalled holder keeps running once it gets SIGCONT: whatever it does after its lease expired and another process
took the run must leave no trace. The negative control (NC1) runs the mid-tool stall on a build whose saves ignore
the fence: the checker must fail there, or it could not see the bug the fence prevents.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import checker
from tests.support.agents import run_input
from tests.support.cluster import AGENTS_MODULE, Cluster, wait_until
from tests.support.unfenced import ENV as UNFENCED_ENV

pytestmark = pytest.mark.crash

#: Three lease TTLs of the test settings: the lease expires and the sweep hands the run to another process.
STALL_S = 6.0


def _stopped_pid(cluster: Cluster, point: str, run_id: str, timeout: float = 20.0) -> int:
    marker = Path(cluster.crash_dir) / f"stop-{point}-{run_id}"
    wait_until(marker.exists, timeout, f"the stop at {point}")
    wait_until(lambda: bool(marker.read_text()), 2, "the stopped pid")
    return int(marker.read_text())


def _executions(cluster: Cluster, run_id: str) -> Counter[str]:
    return Counter(
        str(e["tool_call_id"])
        for e in cluster.events()
        if e.get("kind") == "tool" and e.get("phase") == "start" and e.get("run_id") == run_id
    )


def _stall(cluster: Cluster, pid: int) -> None:
    """Keep ``pid`` stopped for ``STALL_S`` (recorded as a fault), then let it go on."""
    fault = cluster.stop(pid)  # already stopped by itself: this records the stall with the leases it held
    try:
        time.sleep(STALL_S)
    finally:
        cluster.resume(pid)
    assert fault.pids == (pid,)


def test_a_holder_stalled_after_taking_the_lease_is_fenced_out_when_it_wakes(
    make_cluster: Callable[..., Cluster],
) -> None:
    run_id = "stall-cp1"
    cluster = make_cluster(extra_env={"LOUSHO_STOP_AT": f"after_lease_before_epoch:{run_id}"})
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    cluster.send("chaos", run_id, run_input(run_id, turns=3, calls="2", sleep="20-40"))
    _stall(cluster, _stopped_pid(cluster, "after_lease_before_epoch", run_id))
    cluster.wait_finished([run_id], timeout=40)
    report = checker.check(cluster.database_url, cluster.log_path, expected=[run_id], faults=cluster.faults)
    checker.print_report(report, "holder SIGSTOPped at cp1 (after the lease, before the fence)")
    checker.assert_clean(report)
    outcomes = cluster.outcomes()
    print(f"cp1 stall: outcomes {dict(outcomes)}, recovery {report['recovery']['max_s']} s")
    # The woken holder claimed nothing: its token is below the new holder's fence.
    assert outcomes["busy"] + outcomes["fenced"] + outcomes["stale"] >= 1
    assert max(_executions(cluster, run_id).values()) == 1


def test_a_holder_stalled_after_the_started_marker_runs_the_approved_call_at_most_once(
    make_cluster: Callable[..., Cluster],
) -> None:
    run_id = "stall-cp11"
    point = "after_started_marker_before_approved_call"
    cluster = make_cluster(extra_env={"LOUSHO_STOP_AT": f"{point}:{run_id}"})
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    cluster.send("chaos", run_id, run_input(run_id, turns=2, calls="2", gate="0.0", sleep="20-40"))
    wait_until(lambda: cluster.approve_pending("chaos") > 0, 20, "the gated call to wait for approval")
    _stall(cluster, _stopped_pid(cluster, point, run_id))
    cluster.wait_finished([run_id], timeout=40)
    report = checker.check(cluster.database_url, cluster.log_path, expected=[run_id], faults=cluster.faults)
    checker.print_report(report, "holder SIGSTOPped at cp11 (started marker saved, approved call not run)")
    checker.assert_clean(report)
    approved = [call for call in _executions(cluster, run_id) if call.startswith("c0-0-")]
    ran = sum(_executions(cluster, run_id)[call] for call in approved)
    refused = cluster.worker_logs().count(f"save refused for {run_id}")
    print(
        f"cp11 stall: approved call executions {ran} (the woken holder's, at most), fenced saves {refused},"
        f" interrupted results {report['per_run'][run_id]['interrupted_results']}"
    )
    assert ran <= 1


def test_negative_control_a_build_without_the_fence_is_caught_by_the_checker(
    make_cluster: Callable[..., Cluster],
) -> None:
    run_id = "unfenced"
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": f"{AGENTS_MODULE},tests.support.unfenced", UNFENCED_ENV: "1"})
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    cluster.send("chaos", run_id, run_input(run_id, slow="1.0:2500", sleep="20-60"))
    slow = cluster.wait_event(
        lambda e: (
            e.get("kind") == "tool"
            and e.get("phase") == "start"
            and e.get("run_id") == run_id
            and str(e.get("tool_call_id")).startswith("c1-0-")
        ),
        what="the slow tool call to start",
    )
    zombie = int(slow["pid"])
    cluster.stop(zombie)
    try:
        time.sleep(STALL_S)
    finally:
        cluster.resume(zombie)
    time.sleep(4.0)  # the woken holder's late save lands
    try:
        cluster.wait_finished([run_id], timeout=30)
    except AssertionError:
        pass  # a broken build may not finish the run at all; the checker says what went wrong either way
    report = checker.check(cluster.database_url, cluster.log_path, expected=[run_id], faults=cluster.faults)
    checker.print_report(report, "NC1: saves without the fence, holder SIGSTOPped mid-tool")
    print(f"NC1: the checker found {len(report['violations'])} violation(s): {report['violations'][:3]}")
    assert report["violations"], "the checker did not see a late save that the fence would have refused"
