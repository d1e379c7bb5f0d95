"""Approvals and questions that expire, with real ``celery worker`` and ``celery beat`` processes: left
undecided, the recovery sweep rejects them and the run finishes with the rejected and declined results; a
decision that comes too late is refused and the run still goes on."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC
from typing import Any

import pytest

from store import errors
from store.approvals import EXPIRED_NOTE
from store.records import Approval
from tests.support.cluster import Cluster, fresh_id, wait_until
from tests.support.expiry_agents import AGENT, DONE, EXPIRES_IN_S, ask

MODULE = "tests.support.expiry_agents"
#: On top of the expiry: a sweep interval until the pass that rejects them and sends the run, one step,
#: and a loaded 2-core machine.
SLACK_S = 8.0


def _cluster(make_cluster: Callable[..., Cluster], *, beat: bool) -> Cluster:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": MODULE})
    cluster.start_worker(concurrency=2)
    if beat:
        cluster.start_beat()
    return cluster


def _paused(cluster: Cluster, session_id: str) -> dict[str, Approval]:
    """Send the run, wait for its pause, and return its approvals by tool name."""
    cluster.client.agent(AGENT).send(ask(session_id), session_id=session_id, check_agent=False)
    wait_until(
        lambda: cluster.statuses([session_id]).get(session_id, {}).get("status") == "awaiting-approval",
        20,
        f"{session_id} to pause on its approval and question",
    )
    found = {a.tool_name: a for a in cluster.client.agent(AGENT).approvals.list() if a.session_id == session_id}
    assert sorted(found) == ["ask_question", "refund"]
    return found


def _shown(cluster: Cluster, session_id: str) -> dict[str, Any]:
    """The tool results the model was shown on its last turn, by tool name."""
    turns = [e for e in cluster.events() if e.get("kind") == "model" and e.get("run_id") == session_id]
    assert [e["turn_index"] for e in turns] == [0, 1], turns
    results: dict[str, Any] = turns[-1]["results"]
    return results


def _refunds(cluster: Cluster, session_id: str) -> int:
    return sum(1 for e in cluster.events() if e.get("kind") == "tool" and e.get("run_id") == session_id)


def _note(approval: Approval) -> str:
    assert approval.expires_at is not None
    return EXPIRED_NOTE + approval.expires_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f+00:00")


def _decided(cluster: Cluster, approvals: dict[str, Approval]) -> dict[str, Approval]:
    ids = {name: a.approval_id for name, a in approvals.items()}
    found = cluster.client.agent(AGENT).approvals._store.by_ids(list(ids.values()))
    return {name: found[approval_id] for name, approval_id in ids.items()}


def test_an_undecided_approval_and_question_expire_and_the_run_finishes_with_them_rejected(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = _cluster(make_cluster, beat=True)
    session_id = fresh_id("expire")
    approvals = _paused(cluster, session_id)
    paused = time.time()
    for approval in approvals.values():
        assert approval.expires_at is not None and approval.created_at is not None
        assert (approval.expires_at - approval.created_at).total_seconds() == EXPIRES_IN_S

    # Nobody decides: the beat's sweeps reject both once they expire and send the run on.
    waited = cluster.wait_finished([session_id], timeout=EXPIRES_IN_S + SLACK_S)
    print(f"finished {time.time() - paused:.2f} s after the pause (expiry {EXPIRES_IN_S} s), waited {waited:.2f} s")

    checkpoint = cluster.client.agent(AGENT).load(session_id)
    assert checkpoint is not None and checkpoint.final_text == DONE
    shown = _shown(cluster, session_id)
    assert (shown["refund"]["kind"], shown["refund"]["note"]) == ("rejected", _note(approvals["refund"]))
    assert (shown["ask_question"]["kind"], shown["ask_question"]["note"]) == (
        "declined",
        _note(approvals["ask_question"]),
    )
    assert _refunds(cluster, session_id) == 0  # the expired call never ran
    decided = _decided(cluster, approvals)
    assert {name: (a.status, a.note) for name, a in decided.items()} == {
        name: ("rejected", _note(a)) for name, a in approvals.items()
    }
    assert "recover: 2 approval(s) expired undecided" in cluster.worker_logs()
    # A decision now is refused as for any decided approval: the expiry already decided it.
    with pytest.raises(errors.ApprovalNotFoundError) as refused:
        cluster.client.agent(AGENT).approvals.resolve(approvals["refund"].approval_id, approved=True)
    assert refused.value.code == "LOUSHO_APPROVAL_NOT_FOUND"


def test_a_late_decision_raises_approval_expired_and_the_run_goes_on_with_the_rejection(
    make_cluster: Callable[..., Cluster],
) -> None:
    # No beat yet: nothing rejects the expired approval before the person's late decision does.
    cluster = _cluster(make_cluster, beat=False)
    session_id = fresh_id("late")
    approvals = _paused(cluster, session_id)
    handle = cluster.client.agent(AGENT)
    handle.approvals.resolve(approvals["ask_question"].approval_id, answer="card")  # in time

    expires_at = approvals["refund"].expires_at
    assert expires_at is not None
    time.sleep(max(0.0, expires_at.timestamp() - time.time()) + 0.3)
    with pytest.raises(errors.ApprovalExpiredError) as late:
        handle.approvals.resolve(approvals["refund"].approval_id, approved=True, note="go ahead")
    assert late.value.code == "LOUSHO_APPROVAL_EXPIRED"
    decided = _decided(cluster, approvals)
    assert (decided["refund"].status, decided["refund"].note) == ("rejected", _note(approvals["refund"]))
    assert cluster.statuses([session_id])[session_id]["status"] == "in-progress"

    # The refused decision sent nothing; the recovery sweep finds the run and sends it.
    cluster.start_beat()
    cluster.wait_finished([session_id], timeout=SLACK_S + 10)
    shown = _shown(cluster, session_id)
    assert shown["ask_question"] == {"answer": "card"}
    assert (shown["refund"]["kind"], shown["refund"]["note"]) == ("rejected", _note(approvals["refund"]))
    assert _refunds(cluster, session_id) == 0
