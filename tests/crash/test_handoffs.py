"""A handoff followed by a crash: the run resumes as the agent it was handed to (real ``celery worker`` processes)."""

from __future__ import annotations

from collections.abc import Callable

from tests.support import checker
from tests.support.agents import run_input
from tests.support.cluster import Cluster, fresh_id
from tests.support.handoff_agents import FRONT, REFUNDS

MODULE = "tests.support.handoff_agents"


def test_a_run_handed_off_and_then_crashed_resumes_as_the_agent_it_was_handed_to(
        make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": MODULE})
    first = cluster.start_worker(concurrency=1)
    cluster.start_beat()
    session_id = fresh_id("handed")
    cluster.send(FRONT, session_id, run_input(session_id))
    cluster.wait_event(lambda e: e.get("kind") == "tool" and e.get("phase") == "start"
                       and e.get("run_id") == session_id, what="the refund desk's call to start")
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
