"""People and tools that stop a run, with real workers: a question answered from another process after the
worker that asked it was killed, a declined question, and ``PropagatingToolError`` in the middle of a batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from store import errors
from store.records import Checkpoint
from tests.support import checker, services
from tests.support.agents import run_input
from tests.support.cluster import Cluster, fresh_id, wait_until
from tests.support.human_agents import (
    ASKER,
    BOOKED,
    NOT_BOOKED,
    OPTIONS,
    QUESTION,
    SHIPPER,
    outage_marker,
)

MODULE = "tests.support.human_agents"
ROOT = Path(__file__).resolve().parents[2]
#: Recover sweeps the new worker must receive while the question waits, without the run moving.
SWEEPS = 2


def _cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": MODULE})
    cluster.start_worker(concurrency=1)
    return cluster


def _calls(checkpoint: Checkpoint) -> dict[str, str]:
    """Call id -> tool name, for every call the model made."""
    return {c.id: c.name for m in checkpoint.messages if m.role == "assistant" for c in m.tool_calls or ()}


def _results(checkpoint: Checkpoint) -> dict[str, dict[str, Any]]:
    """Call id -> the JSON body of its saved result."""
    return {str(m.tool_call_id): json.loads(str(m.content)) for m in checkpoint.messages if m.role == "tool"}


def _paused_on_question(cluster: Cluster, session_id: str) -> tuple[str, str, str]:
    """Wait for the asker's run to pause; (approval id, question call id, ordinary call id)."""
    wait_until(
        lambda: cluster.statuses([session_id]).get(session_id, {}).get("status") == "awaiting-approval",
        20,
        f"{session_id} to pause on its question",
    )
    (approval,) = cluster.client.agent(ASKER).approvals.list()
    assert (approval.session_id, approval.kind, approval.tool_name) == (session_id, "question", "ask_question")
    assert (approval.question, approval.options) == (QUESTION, OPTIONS)
    checkpoint = cluster.checkpoint(ASKER, session_id)
    calls = _calls(checkpoint)
    (work_id,) = [call_id for call_id, name in calls.items() if name == "work"]
    assert calls[approval.tool_call_id] == "ask_question"
    # The other call of the turn ran while the question waits, and its result is saved.
    results = _results(checkpoint)
    assert list(results) == [work_id] and "exec" in results[work_id]
    assert cluster.call_starts(session_id) == Counter({work_id: 1})
    return approval.approval_id, approval.tool_call_id, work_id


def _assert_checked(cluster: Cluster, session_id: str, title: str) -> None:
    """The checker finds nothing wrong with the run (a question's result came from a person: it checks that)."""
    report = checker.check(cluster.database_url, cluster.log_path, expected=[session_id], faults=cluster.faults)
    checker.print_report(report, title)
    left = report["violations"]
    assert not left, f"{len(left)} violation(s):\n" + "\n".join(left[:20])


def test_a_question_is_answered_from_another_process_after_the_asking_worker_was_killed(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = _cluster(make_cluster)
    cluster.start_beat()
    session_id = fresh_id("asked")
    cluster.send(ASKER, session_id, run_input(session_id))
    approval_id, question_id, work_id = _paused_on_question(cluster, session_id)
    assert [(p.state, p.approval_kind) for p in cluster.client.agent(ASKER).pending()] == [
        ("awaiting-approval", "question")
    ]

    # The worker that asked dies; a new one starts, and the sweep leaves the waiting run alone.
    (first,) = cluster.live_workers()
    cluster.kill_group(first)
    cluster.start_worker(name="w2", concurrency=1)
    seq = cluster.statuses([session_id])[session_id]["seq"]
    _, received = cluster.sweeps()
    wait_until(lambda: cluster.sweeps()[1] >= received + SWEEPS, 15, f"{SWEEPS} sweeps by the new worker")
    waiting = cluster.statuses([session_id])[session_id]
    assert (waiting["status"], waiting["seq"]) == ("awaiting-approval", seq)
    assert len(cluster.model_starts(session_id)) == 1

    # The person answers through the command line, another OS process.
    answered = subprocess.run(
        [sys.executable, "-m", "producer.cli", "approvals", "answer", approval_id, "Oslo", "--json"],
        cwd=ROOT,
        env={**os.environ, **services.test_environment()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert answered.returncode == 0, answered.stderr
    assert json.loads(answered.stdout) == {"approval_id": approval_id, "decision": "answered", "session_id": session_id}
    cluster.wait_finished([session_id], timeout=20)

    checkpoint = cluster.checkpoint(ASKER, session_id)
    assert checkpoint.finish_reason == "stop"
    assert _results(checkpoint)[question_id] == {"answer": "Oslo"}
    final = checkpoint.messages[-1]
    assert final.role == "assistant" and str(final.content).startswith(BOOKED + "Oslo")
    assert cluster.call_starts(session_id) == Counter({work_id: 1})  # the ordinary call did not run again
    assert cluster.client.agent(ASKER).approvals.list() == []
    _assert_checked(cluster, session_id, "question answered after a worker restart")


def test_a_declined_question_finishes_the_run_with_the_declined_result_and_cannot_be_decided_again(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = _cluster(make_cluster)
    session_id = fresh_id("declined")
    cluster.send(ASKER, session_id, run_input(session_id))
    approval_id, question_id, work_id = _paused_on_question(cluster, session_id)
    approvals = cluster.client.agent(ASKER).approvals

    result = approvals.resolve(approval_id, approved=False, note="ask me tomorrow").wait(timeout=20)

    assert result.finish_reason == "stop" and str(result.text).startswith(NOT_BOOKED + "ask me tomorrow")
    declined = _results(cluster.checkpoint(ASKER, session_id))[question_id]
    assert (declined["kind"], declined["error"], declined["note"]) == (
        "declined",
        "QuestionDeclined",
        "ask me tomorrow",
    )
    with pytest.raises(errors.ApprovalNotFoundError):
        approvals.resolve(approval_id, approved=False, note="again")
    with pytest.raises(errors.ApprovalNotFoundError):
        approvals.resolve(approval_id, answer="Rome")
    assert _results(cluster.checkpoint(ASKER, session_id))[question_id] == declined
    assert cluster.call_starts(session_id) == Counter({work_id: 1})
    _assert_checked(cluster, session_id, "question declined")


def test_a_propagating_tool_error_mid_batch_parks_the_run_and_resume_runs_only_the_raising_call_again(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = _cluster(make_cluster)
    handle = cluster.client.agent(SHIPPER)
    session_id = fresh_id("propagated")
    marker = outage_marker(cluster.log_path, session_id)
    marker.touch()
    run = handle.send(run_input(session_id), session_id=session_id, check_agent=False)

    with pytest.raises(errors.PropagatingToolError):
        run.wait(timeout=20)

    checkpoint = cluster.checkpoint(SHIPPER, session_id)
    first, middle, last = _calls(checkpoint)
    assert _calls(checkpoint)[middle] == "ship" and checkpoint.status == "in-progress"
    # The calls beside the raising one finished after it raised, and their results were saved; it has none.
    saved = _results(checkpoint)
    assert sorted(saved) == sorted([first, last]) and all("exec" in body for body in saved.values())
    log = [e for e in cluster.events() if e.get("kind") == "tool" and e.get("run_id") == session_id]
    (raised,) = [e for e in log if e["phase"] == "raised"]
    assert raised["tool_call_id"] == middle
    assert any(e["phase"] == "end" and e["ts"] > raised["ts"] for e in log)
    assert [(p.session_id, p.state, p.last_error.code if p.last_error else None) for p in handle.pending()] == [
        (session_id, "parked", errors.PropagatingToolError.code)
    ]
    assert cluster.call_starts(session_id) == Counter({first: 1, middle: 1, last: 1})

    marker.unlink()  # the carrier is back
    resumed = handle.resume(session_id)
    assert resumed is not None
    result = resumed.wait(timeout=20)

    assert result.finish_reason == "stop"
    assert cluster.call_starts(session_id) == Counter({first: 1, middle: 2, last: 1})
    finished = _results(cluster.checkpoint(SHIPPER, session_id))
    assert finished[middle]["shipped"] == session_id
    assert {call_id: finished[call_id] for call_id in (first, last)} == saved  # kept as they were
    assert handle.pending() == []
    _assert_checked(cluster, session_id, "PropagatingToolError mid-batch, then resume")
