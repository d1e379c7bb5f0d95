"""Handoffs with real ``celery worker`` processes: a run handed off and then crashed resumes as the agent it was
handed to; a handoff in a turn with a gated call waits for the decision, and the approved call runs as its asker."""

from __future__ import annotations

from collections.abc import Callable

from tests.support import checker
from tests.support.agents import run_input
from tests.support.cluster import Cluster, fresh_id, wait_until
from tests.support.handoff_agents import FRONT, GATED_FRONT, REFUNDS

MODULE = "tests.support.handoff_agents"


def test_a_run_handed_off_and_then_crashed_resumes_as_the_agent_it_was_handed_to(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": MODULE})
    first = cluster.start_worker(concurrency=1)
    cluster.start_beat()
    session_id = fresh_id("handed")
    cluster.send(FRONT, session_id, run_input(session_id))
    cluster.wait_event(
        lambda e: e.get("kind") == "tool" and e.get("phase") == "start" and e.get("run_id") == session_id,
        what="the refund desk's call to start",
    )
    handed = cluster.checkpoint(FRONT, session_id)
    assert handed.active_agent == REFUNDS and handed.agent == FRONT
    cluster.kill_group(first)
    cluster.start_worker(name="w2", concurrency=1)
    cluster.wait_finished([session_id], timeout=60)

    finished = cluster.checkpoint(FRONT, session_id)
    assert finished.final_text is not None and finished.final_text.startswith("refunds answered")
    assert finished.active_agent == REFUNDS
    models = cluster.model_starts(session_id)
    assert [m["turn_index"] for m in models].count(0) == 1  # the front desk answered once, before the handoff
    assert len(cluster.call_starts(session_id)) == 1  # the refund call (run again after the kill)
    report = checker.check(cluster.database_url, cluster.log_path, expected=[session_id], faults=cluster.faults)
    checker.print_report(report, "handoff, then a worker killed mid-call")
    assert not report["violations"], "\n".join(report["violations"][:20])


def test_a_handoff_waits_for_its_turns_approval_and_the_approved_call_runs_as_the_agent_that_asked(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": MODULE})
    first = cluster.start_worker(concurrency=1)
    cluster.start_beat()
    session_id = fresh_id("gated-handoff")
    cluster.send(GATED_FRONT, session_id, run_input(session_id))
    wait_until(
        lambda: cluster.statuses([session_id]).get(session_id, {}).get("status") == "awaiting-approval",
        20,
        "the run to pause on its approval",
    )
    held = cluster.checkpoint(GATED_FRONT, session_id)
    assert held.active_agent is None  # the handoff waits for the decision
    (approval_id,) = held.approval_ids
    cluster.client.agent(GATED_FRONT).approvals.resolve(approval_id, approved=True)
    cluster.wait_event(
        lambda e: (
            e.get("kind") == "tool"
            and e.get("phase") == "start"
            and bool(e.get("approved"))
            and e.get("run_id") == session_id
        ),
        what="the approved call to start",
    )
    cluster.kill_group(first)  # mid-call: the approved call gets an interrupted result, never a second run
    cluster.start_worker(name="w2", concurrency=1)
    cluster.wait_finished([session_id], timeout=60)

    finished = cluster.checkpoint(GATED_FRONT, session_id)
    assert finished.last_error is None and finished.active_agent == REFUNDS
    assert finished.final_text is not None and finished.final_text.startswith("refunds answered")
    approved_runs = [
        e
        for e in cluster.events()
        if e.get("kind") == "tool" and e.get("phase") == "start" and e.get("approved") and e.get("run_id") == session_id
    ]
    assert len(approved_runs) == 1
    gated, handed = [m for m in finished.messages if m.role == "tool"][:2]
    assert gated.is_error and "interrupted" in str(gated.content)
    assert "transferred_to" in str(handed.content)
    report = checker.check(cluster.database_url, cluster.log_path, expected=[session_id], faults=cluster.faults)
    checker.print_report(report, "handoff held for an approval, then a worker killed mid-call")
    assert not report["violations"], "\n".join(report["violations"][:20])
