"""Approvals with real workers and real process deaths: an approved call runs at most once (I5), a
stale approval never comes back (I6), and a decision survives the death of the process that made it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from store import errors
from tests.support import checker, services
from tests.support.agents import run_input
from tests.support.checker import APPROVED_TOOL
from tests.support.cluster import Cluster, is_alive, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _approved_executions(cluster: Cluster, run_id: str) -> Counter[str]:
    return Counter(
        str(e["tool_call_id"])
        for e in cluster.events()
        if e.get("kind") == "tool" and e.get("phase") == "start" and e.get("run_id") == run_id and e.get("approved")
    )


def _paused(cluster: Cluster, run_id: str, timeout: float = 20) -> list[str]:
    wait_until(
        lambda: cluster.statuses([run_id]).get(run_id, {}).get("status") == "awaiting-approval",
        timeout,
        f"{run_id} to pause on its approvals",
    )
    checkpoint = cluster.client.store.load(run_id)
    assert checkpoint is not None
    return list(checkpoint.approval_ids)


def _tool_results(cluster: Cluster, run_id: str) -> list[dict[str, object]]:
    checkpoint = cluster.client.store.load(run_id)
    assert checkpoint is not None
    return [
        {"id": m.tool_call_id, "name": m.name, "error": m.is_error, "content": m.content}
        for m in checkpoint.messages
        if m.role == "tool"
    ]


def test_a_turn_with_two_gated_calls_pauses_once_and_finishes_after_both_decisions(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster()
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    run_id = "gated-two"
    cluster.send("chaos", run_id, run_input(run_id, calls="4", gate="0.1,0.3"))
    first, second = _paused(cluster, run_id)
    ungated = [
        e for e in cluster.events() if e.get("kind") == "tool" and e.get("run_id") == run_id and e.get("phase") == "end"
    ]
    assert len(ungated) == 2 and not any(e.get("approved") for e in ungated)
    approvals = cluster.client.agent("chaos").approvals
    approvals.resolve(first, approved=True)
    assert cluster.statuses([run_id])[run_id]["status"] == "awaiting-approval"
    approvals.resolve(second, approved=False, note="not this one")
    cluster.wait_finished([run_id], timeout=30, on_poll=lambda: cluster.approve_pending("chaos"))
    report = checker.check(cluster.database_url, cluster.log_path, expected=[run_id], faults=cluster.faults)
    checker.print_report(report, "two gated calls in one turn")
    checker.assert_clean(report)
    results = _tool_results(cluster, run_id)[:4]
    assert [r["name"] for r in results] == ["work", APPROVED_TOOL, "work", APPROVED_TOOL]
    rejection = json.loads(str(results[3]["content"]))
    assert rejection["kind"] == "rejected" and rejection["note"] == "not this one"
    assert sum(_approved_executions(cluster, run_id).values()) == 1


def test_a_worker_killed_while_an_approved_call_runs_never_runs_it_again(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster()
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    run_id = "approved-killed"
    cluster.send("chaos", run_id, run_input(run_id, gate="0.1", slow="0.1:3000"))
    (approval_id,) = _paused(cluster, run_id)
    cluster.client.agent("chaos").approvals.resolve(approval_id, approved=True)
    started = cluster.wait_event(
        lambda e: (
            e.get("kind") == "tool"
            and e.get("phase") == "start"
            and e.get("run_id") == run_id
            and bool(e.get("approved"))
        ),
        what="the approved call to start",
    )
    holder = cluster.holder_pid(run_id)
    assert holder is not None and holder == started["pid"] and is_alive(holder)
    cluster.kill_pid(holder)
    cluster.wait_finished([run_id], timeout=40, on_poll=lambda: cluster.approve_pending("chaos"))
    report = checker.check(cluster.database_url, cluster.log_path, expected=[run_id], faults=cluster.faults)
    checker.print_report(report, "worker SIGKILLed during an approved call")
    checker.assert_clean(report)
    call_id = str(started["tool_call_id"])
    assert _approved_executions(cluster, run_id)[call_id] == 1
    (result,) = [r for r in _tool_results(cluster, run_id) if r["id"] == call_id]
    assert result["error"] and json.loads(str(result["content"]))["kind"] == "interrupted"
    print(f"approved call executions: 1, result: interrupted, recovery {report['recovery']['max_s']} s")


def test_a_decision_whose_process_died_before_the_resume_is_picked_up_by_the_sweep(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = make_cluster()
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    run_id = "decided-then-died"
    cluster.send("chaos", run_id, run_input(run_id, gate="0.1"))
    (approval_id,) = _paused(cluster, run_id)
    env = {
        **os.environ,
        **services.test_environment(),
        "LOUSHO_CRASH_AT": "approval_decided_before_resume_enqueue",
        "LOUSHO_CRASH_DIR": str(tmp_path),
    }
    code = (
        "import sys; from producer import Client; Client().agent('chaos').approvals.resolve(sys.argv[1], approved=True)"
    )
    died = subprocess.run([sys.executable, "-c", code, approval_id], cwd=ROOT, env=env, timeout=60)
    assert died.returncode == 137
    assert (tmp_path / f"crash-approval_decided_before_resume_enqueue-{run_id}").exists()
    assert cluster.statuses([run_id])[run_id]["status"] == "in-progress"  # decided, no message sent
    waited = cluster.wait_finished([run_id], timeout=30)
    report = checker.check(cluster.database_url, cluster.log_path, expected=[run_id], faults=cluster.faults)
    checker.print_report(report, "decision made, resume never enqueued")
    checker.assert_clean(report)
    assert sum(_approved_executions(cluster, run_id).values()) == 1
    print(f"run finished {waited:.1f} s after the deciding process died (the sweep re-enqueued it)")


def test_ten_concurrent_resolves_from_ten_processes_decide_once(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster()
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    cluster.send("chaos", "ten-resolves", run_input("ten-resolves", gate="0.0"))
    (approval_id,) = _paused(cluster, "ten-resolves")

    def resolve(_: int) -> str:
        code = (
            "import sys; from producer import Client\n"
            "try:\n Client().agent('chaos').approvals.resolve(sys.argv[1], approved=True); print('decided')\n"
            "except Exception as e:\n print(getattr(e, 'code', type(e).__name__))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, approval_id],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, **services.test_environment()},
            timeout=60,
        )
        return done.stdout.strip().splitlines()[-1]

    with ThreadPoolExecutor(max_workers=10) as pool:
        outcomes = Counter(pool.map(resolve, range(10)))
    assert outcomes == Counter({"decided": 1, errors.ApprovalNotFoundError.code: 9}), outcomes
    cluster.wait_finished(["ten-resolves"], timeout=30)
    report = checker.check(cluster.database_url, cluster.log_path, expected=["ten-resolves"], faults=cluster.faults)
    checker.print_report(report, "ten concurrent resolves")
    checker.assert_clean(report)
    assert sum(_approved_executions(cluster, "ten-resolves").values()) == 1
    print(f"resolves: {dict(outcomes)}; approved executions: 1")


def test_resolving_an_approval_of_a_deleted_run_is_orphaned_and_runs_nothing(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster()
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    cluster.send("chaos", "deleted", run_input("deleted", gate="0.0"))
    (orphan_id,) = _paused(cluster, "deleted")
    assert cluster.client.agent("chaos").delete("deleted")
    cluster.send("chaos", "deleted", run_input("deleted", turns="1"))  # a newer run under the same id
    cluster.wait_finished(["deleted"], timeout=30)
    for _ in range(2):
        try:
            cluster.client.agent("chaos").approvals.resolve(orphan_id, approved=True)
            raise AssertionError("a deleted run's approval was accepted")
        except errors.ApprovalOrphanedError:
            pass
    assert cluster.client.agent("chaos").approvals.list() == []
    assert sum(_approved_executions(cluster, "deleted").values()) == 0
    final = cluster.client.store.load("deleted")
    assert final is not None and final.status == "finished" and final.approval_ids == []
    print("orphaned approvals: 1, executions of it: 0, newer run untouched")
