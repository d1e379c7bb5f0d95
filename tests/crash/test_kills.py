"""Real worker processes killed or stopped by the test at a chosen moment of a run (SIGKILL, SIGSTOP)."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable

import pytest

from tests.support import checker
from tests.support.agents import run_input
from tests.support.cluster import Cluster, is_alive, wait_until

#: The slow call or model turn each single-run test kills: the recovered step repeats it, so it is
#: the "one step" of I11 there.
SLOW_MS = 1500
#: Tools of the worker-replacement runs sleep 300-700 ms.
SLEEP_MS = (300, 700)
#: On top of I11's bound: two hops through Redis to a pool process (beat -> recover task,
#: recover -> step) and scheduling noise on a loaded 2-core machine (other crash tests running).
SLACK_S = 2.0


def _tool_started(run_id: str, call_prefix: str) -> Callable[[dict[str, object]], bool]:
    return lambda e: (
        e.get("kind") == "tool"
        and e.get("phase") == "start"
        and e.get("run_id") == run_id
        and str(e.get("tool_call_id")).startswith(call_prefix)
    )


def _executions(cluster: Cluster, run_id: str) -> Counter[str]:
    return Counter(
        str(e["tool_call_id"])
        for e in cluster.events()
        if e.get("kind") == "tool" and e.get("phase") == "start" and e.get("run_id") == run_id
    )


def test_child_killed_mid_tool_reruns_only_the_interrupted_call(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster()
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    run_id = "kill-tool"
    # Turn 1: call 0 sleeps 1.5 s (killed there), call 1 is fast and recorded before the kill.
    cluster.send("chaos", run_id, run_input(run_id, slow=f"1.0:{SLOW_MS}", sleep="20-60"))

    slow = cluster.wait_event(_tool_started(run_id, "c1-0-"), what="the slow tool call to start")
    wait_until(lambda: cluster.statuses([run_id])[run_id]["seq"] >= 6, 10, "the fast call's result save")
    holder = cluster.holder_pid(run_id)
    assert holder is not None and holder == slow["pid"] and is_alive(holder), f"lease: {holder}, call: {slow['pid']}"
    fault = cluster.kill_pid(holder)
    assert fault.runs == (run_id,)
    # The first save after the kill is the slow call's result: the recovered step runs it again.
    budget = cluster.recovery_budget(SLOW_MS / 1000, SLACK_S)

    cluster.wait_finished([run_id], timeout=30)
    report = checker.check(cluster.database_url, cluster.log_path, expected=[run_id], faults=cluster.faults)
    checker.print_report(report, "child SIGKILLed mid-tool")
    checker.assert_clean(report)
    executions = _executions(cluster, run_id)
    assert executions[str(slow["tool_call_id"])] == 2
    assert report["raw_reexecutions"] == 1, executions
    assert len(executions) == 5 and report["executions"] == 6
    print(f"recovery after the kill: {report['recovery']['max_s']} s (budget {budget})")
    assert report["recovery"]["max_s"] is not None and report["recovery"]["max_s"] <= budget.limit_s


def test_child_killed_mid_model_call_regenerates_only_the_unsaved_turn(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster()
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    run_id = "kill-model"
    cluster.send("chaos", run_id, run_input(run_id, slowmodel=f"1:{SLOW_MS}"))
    # The first save after the kill is turn 1, generated again.
    budget = cluster.recovery_budget(SLOW_MS / 1000, SLACK_S)

    call = cluster.wait_event(
        lambda e: (
            e.get("kind") == "model"
            and e.get("phase") == "start"
            and e.get("run_id") == run_id
            and e.get("turn_index") == 1
        ),
        what="the slow model call",
    )
    time.sleep(0.2)
    holder = cluster.holder_pid(run_id)
    assert holder is not None and holder == call["pid"] and is_alive(holder)
    cluster.kill_pid(holder)

    cluster.wait_finished([run_id], timeout=30)
    report = checker.check(cluster.database_url, cluster.log_path, expected=[run_id], faults=cluster.faults)
    checker.print_report(report, "child SIGKILLed mid-model-call")
    checker.assert_clean(report)
    assert report["interrupted_model_calls"] == 1
    assert report["wasted_model_calls"] == 0
    assert report["raw_reexecutions"] == 0
    assert report["model_calls"] == 4
    print(f"recovery after the kill: {report['recovery']['max_s']} s (budget {budget})")
    assert report["recovery"]["max_s"] is not None and report["recovery"]["max_s"] <= budget.limit_s


@pytest.mark.parametrize("action", ["kill-group", "kill-main"])
def test_killed_worker_is_replaced_and_its_runs_finish(make_cluster: Callable[..., Cluster], action: str) -> None:
    cluster = make_cluster()
    concurrency = 2
    first = cluster.start_worker("w1", concurrency=concurrency)
    cluster.start_beat()
    run_ids = [f"{action}-{n}" for n in range(4)]
    for run_id in run_ids:
        cluster.send("chaos", run_id, run_input(run_id, sleep="{}-{}".format(*SLEEP_MS)))
    wait_until(
        lambda: len(set(cluster.lease_holders().values()) & set(first.children())) >= 2,
        15,
        "both pool processes holding a lease",
    )

    # Killing the main process only must take its pool children down too, or they would go on
    # renewing leases for runs nobody finishes.
    fault = cluster.kill_group(first) if action == "kill-group" else cluster.kill_main(first)
    assert fault.runs, "the kill hit no lease holder"
    wait_until(lambda: not any(is_alive(pid) for pid in fault.pids), 5, "every process of the worker to die")
    cluster.start_worker("w2", concurrency=concurrency)
    workerless_s = time.time() - fault.ts

    waited = cluster.wait_finished(run_ids, timeout=45)
    report = checker.check(cluster.database_url, cluster.log_path, expected=run_ids, faults=cluster.faults)
    checker.print_report(report, f"worker SIGKILLed ({action})")
    checker.assert_clean(report)
    # The sweep needs a live worker: the time without one beyond the TTL adds to the bound. One
    # step is a run's longest call, queued behind the other runs' steps on the new worker's pool.
    ttl_s = cluster.settings().lease_ttl_ms / 1000
    budget = cluster.recovery_budget(
        math.ceil(len(run_ids) / concurrency) * SLEEP_MS[1] / 1000, round(max(0.0, workerless_s - ttl_s), 3) + SLACK_S
    )
    print(
        f"runs hit: {len(fault.runs)}, all finished {waited:.1f} s after the kill"
        f" (new worker ready {workerless_s:.1f} s after it), recovery max {report['recovery']['max_s']} s"
        f" (budget {budget})"
    )
    assert report["recovery"]["count"] == len(fault.runs)
    assert report["recovery"]["max_s"] is not None and report["recovery"]["max_s"] <= budget.limit_s


def test_stopped_lease_holder_is_fenced_and_its_late_result_dropped(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster()
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    run_id = "zombie"
    cluster.send("chaos", run_id, run_input(run_id, slow="1.0:2500", sleep="20-60"))

    slow = cluster.wait_event(_tool_started(run_id, "c1-0-"), what="the slow tool call to start")
    wait_until(lambda: cluster.statuses([run_id])[run_id]["seq"] >= 6, 10, "the fast call's result save")
    zombie = int(slow["pid"])
    assert cluster.holder_pid(run_id) == zombie
    fault = cluster.stop(zombie)
    try:
        time.sleep(6.0)  # 3x the lease TTL: the lease expires and the sweep hands the run to the other child
    finally:
        cluster.resume(zombie)
    wait_until(lambda: f"save refused for {run_id}" in cluster.worker_logs(), 10, "the zombie's refused save")
    cluster.wait_finished([run_id], timeout=30)

    report = checker.check(cluster.database_url, cluster.log_path, expected=[run_id], faults=cluster.faults)
    checker.print_report(report, "lease holder SIGSTOPped for 3x TTL")
    checker.assert_clean(report)
    history = cluster.client.agent("chaos").history(run_id)
    zombie_fence = max(h.checkpoint.fence for h in history if h.saved_at.timestamp() < fault.ts)
    late = [h.seq for h in history if h.saved_at.timestamp() > fault.ts and h.checkpoint.fence <= zombie_fence]
    assert not late, f"saves with the zombie's fence after it stopped: {late}"
    refused = [line for line in cluster.worker_logs().splitlines() if f"save refused for {run_id}" in line]
    assert any(f"(fence {zombie_fence})" in line for line in refused), refused
    checkpoint = cluster.client.agent("chaos").load(run_id)
    assert checkpoint is not None
    recorded = {json.loads(str(m.content))["exec"] for m in checkpoint.messages if m.role == "tool"}
    assert slow["exec"] not in recorded, "the zombie's late result reached the transcript"
    executions = _executions(cluster, run_id)
    print(
        f"fenced rejections: {len(refused)}, zombie raw executions: {executions[str(slow['tool_call_id'])] - 1},"
        f" late results in transcript: 0, recovery {report['recovery']['max_s']} s"
    )
    assert cluster.outcomes()["fenced"] >= 1
