"""Business state a tool writes, with real ``celery worker`` processes: the write is saved with the call's result,
so a pool process killed right after that save loses none of it and the call never runs again."""

from __future__ import annotations

from collections.abc import Callable

from tests.support.cluster import Cluster, fresh_id
from tests.support.state_agents import LEDGER

MODULE = "tests.support.state_agents"


def test_a_tools_business_state_write_survives_a_kill_right_after_its_result_is_saved(
    make_cluster: Callable[..., Cluster],
) -> None:
    session_id = fresh_id("ledger")
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": MODULE}, crash_at=f"between_results:{session_id}")
    cluster.start_worker(concurrency=1)
    cluster.start_beat()
    cluster.send(LEDGER, session_id, f"run {session_id}")
    cluster.wait_finished([session_id], timeout=60)

    assert [f.runs for f in cluster.crash_faults()] == [(session_id,)], "the crash point did not fire"
    finished = cluster.checkpoint(LEDGER, session_id)
    assert finished.final_text == "ledger done"
    assert finished.business_state == {"entries": ["a", "b"]}, finished.business_state
    executions = [e["entry"] for e in cluster.events() if e.get("kind") == "ledger" and e.get("run_id") == session_id]
    assert executions == ["a", "b"], executions  # the call whose save the kill followed never ran again
    changes = [e.data for e in cluster.client.read_events(session_id, -1) if e.type == "business_state.changed"]
    assert [c["business_state"] for c in changes] == [{"entries": ["a"]}, {"entries": ["a", "b"]}]
    assert {c["by"] for c in changes} == {"tool"}
