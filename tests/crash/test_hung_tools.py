"""Hung tool calls with real ``celery worker`` processes: past ``LOUSHO_HUNG_TOOL_CALLS_MAX`` a pool process ends
itself after its step and Celery starts a fresh one; the run goes on, nothing runs twice."""

from __future__ import annotations

from collections.abc import Callable

from tests.support.cluster import Cluster, fresh_id, wait_until
from tests.support.hung_agents import AGENT, CALLS

MODULE = "tests.support.hung_agents"


def test_a_pool_process_with_more_hung_calls_than_allowed_is_recycled_and_the_run_goes_on(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": MODULE, "LOUSHO_HUNG_TOOL_CALLS_MAX": "1"})
    worker = cluster.start_worker(concurrency=1)
    cluster.start_beat()
    session_id = fresh_id("hung")
    cluster.send(AGENT, session_id, "call the slow service")
    cluster.wait_finished([session_id], timeout=30)

    finished = cluster.checkpoint(AGENT, session_id)
    assert finished.final_text == "gave up"
    results = [m for m in finished.messages if m.role == "tool"]
    assert len(results) == CALLS and all('"timeout"' in str(m.content) for m in results)
    stalled = [e for e in cluster.events() if e.get("kind") == "stall" and e.get("run_id") == session_id]
    assert len(stalled) == CALLS  # each call ran once: the recycled step was not run again
    before = {e["pid"] for e in stalled}
    wait_until(lambda: "it exits after this step" in cluster.worker_logs(), 10, "the pool process to say it exits")
    assert set(worker.children()) - before, "Celery started a fresh pool process"

    # The fresh process serves the run's next input.
    cluster.send(AGENT, session_id, "are you there?")
    wait_until(lambda: cluster.checkpoint(AGENT, session_id).final_text == "still here", 30, "the follow-up")
    answered = [e for e in cluster.events() if e.get("kind") == "model" and e.get("turn_index") == 2]
    assert answered and answered[-1]["pid"] not in before
