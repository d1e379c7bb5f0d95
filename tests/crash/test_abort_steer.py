"""Abort and steer with real ``celery worker`` processes on the real services: a batch hears them at its
next lease renewal, every call gets exactly one result, and the run goes on only when a person says so."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from store import errors
from store.events import Event
from tests.support.abort_agents import AGENT, HEARD, ask
from tests.support.cluster import Cluster, fresh_id, wait_until

MODULE = "tests.support.abort_agents"
CALLS = 3
CALL_MS = 2000
#: The slow tool waits on ``ctx.cancelled``: it returns as soon as the batch sets it.
REACTION_S = 0.1
#: On top of the renewal interval: the batch's check of the request in Postgres, the running call's
#: result save and the abort's save, ``wait()``'s polling, and a loaded 2-core machine.
SLACK_S = 1.0
#: Sweeps the workers must receive, after the aborted run went quiet for a lease TTL, without moving it.
SWEEPS = 3


def _cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": MODULE})
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    return cluster


def _tool_log(cluster: Cluster, session_id: str, phase: str) -> list[dict[str, Any]]:
    return [
        e
        for e in cluster.events()
        if e.get("kind") == "tool" and e.get("run_id") == session_id and e.get("phase") == phase
    ]


def _model_calls(cluster: Cluster, session_id: str) -> list[dict[str, Any]]:
    return [e for e in cluster.events() if e.get("kind") == "model" and e.get("run_id") == session_id]


def _first_call_started(cluster: Cluster, session_id: str) -> dict[str, Any]:
    return cluster.wait_event(
        lambda e: e.get("kind") == "tool" and e.get("phase") == "start" and e.get("run_id") == session_id,
        what="the first slow call to start",
    )


def _results(cluster: Cluster, session_id: str) -> tuple[list[str], dict[str, list[dict[str, Any]]]]:
    """The first turn's call ids, and each call id's results in the saved transcript."""
    checkpoint = cluster.client.agent(AGENT).load(session_id)
    assert checkpoint is not None
    turn = next(m for m in checkpoint.messages if m.role == "assistant")
    asked = [call.id for call in turn.tool_calls or ()]
    results: dict[str, list[dict[str, Any]]] = {call_id: [] for call_id in asked}
    for message in checkpoint.messages:
        if message.role == "tool":
            body = json.loads(str(message.content)) if message.is_error else {"text": message.content}
            results.setdefault(str(message.tool_call_id), []).append(body)
    return asked, results


def _start_of_input(events: list[Event], number: int) -> int:
    """Index of the ``run.start`` that merged input ``number``."""
    return next(i for i, e in enumerate(events) if e.type == "run.start" and e.data["input_number"] == number)


def test_abort_mid_batch_cancels_the_running_call_starts_no_more_and_a_send_finishes_the_run(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = _cluster(make_cluster)
    settings = cluster.settings()
    handle = cluster.client.agent(AGENT)
    session_id = fresh_id("abort")
    run = handle.send(ask(session_id, calls=CALLS, ms=CALL_MS), session_id=session_id, check_agent=False)

    first = _first_call_started(cluster, session_id)
    asked = time.time()
    assert handle.abort(session_id) is True
    result = run.wait(timeout=15)
    returned = time.time() - asked

    assert result.finish_reason == "aborted"
    events = cluster.client.read_events(session_id, -1)
    done = events[-1]
    assert done.type == "run.done" and done.data["finish_reason"] == "aborted"
    saved = done.at.timestamp() - asked
    renew_s = settings.lease_renew_ms / 1000
    limit_s = round(renew_s + REACTION_S + SLACK_S, 3)
    (ended,) = _tool_log(cluster, session_id, "end")
    print(
        f"abort latency: aborted save {saved:.3f} s after abort(), wait() returned after {returned:.3f} s;"
        f" the running call stopped {ended['ts'] - asked:.3f} s after abort() (limit {limit_s} s = renewal"
        f" {renew_s} + reaction {REACTION_S} + slack {SLACK_S})"
    )
    assert saved <= limit_s and returned <= limit_s

    # The running call stopped on ctx.cancelled; the two after it never started.
    assert [e["tool_call_id"] for e in _tool_log(cluster, session_id, "start")] == [first["tool_call_id"]]
    assert ended["tool_call_id"] == first["tool_call_id"] and ended["cancelled"] is True
    calls, results = _results(cluster, session_id)
    assert len(calls) == CALLS and calls[0] == first["tool_call_id"]
    assert {call_id: [r.get("kind") for r in found] for call_id, found in results.items()} == {
        call_id: ["cancelled"] for call_id in calls
    }
    checkpoint = handle.load(session_id)
    assert checkpoint is not None and checkpoint.status == "in-progress" and checkpoint.aborted
    assert [(p.session_id, p.state) for p in cluster.client.pending()] == [(session_id, "aborted")]

    # The sweep runs on and leaves the run alone: quiet for a lease TTL, then several sweeps later still there.
    seq = cluster.statuses([session_id])[session_id]["seq"]
    _, received = cluster.sweeps()
    quiet_until = done.at.timestamp() + settings.lease_ttl_ms / 1000
    wait_until(
        lambda: time.time() > quiet_until and cluster.sweeps()[1] >= received + SWEEPS,
        10 + SWEEPS * settings.recover_interval_s,
        f"{SWEEPS} sweeps after the aborted run went quiet",
    )
    swept = cluster.sweeps()[1] - received
    assert cluster.statuses([session_id])[session_id]["seq"] == seq
    assert [e.seq for e in cluster.client.read_events(session_id, -1)] == [e.seq for e in events]
    assert len(_model_calls(cluster, session_id)) == 1
    assert [p.state for p in cluster.client.pending()] == ["aborted"]
    print(f"sweeps received while the aborted run sat still: {swept}, its seq stayed {seq}")

    after = handle.send("carry on", session_id=session_id, check_agent=False).wait(timeout=15)
    assert after.finish_reason == "stop" and after.text == HEARD + "carry on"
    assert cluster.client.pending() == []
    assert len(_tool_log(cluster, session_id, "start")) == 1  # nothing ran again

    events = cluster.client.read_events(session_id, -1)
    second = _start_of_input(events, 2)
    assert [e.type for e in events[second - 4 : second]] == ["tool.error"] * 3 + ["run.done"]
    assert [e.data["kind"] for e in events[second - 4 : second - 1]] == ["cancelled"] * 3
    assert sorted(e.data["tool_call_id"] for e in events[second - 4 : second - 1]) == sorted(calls)
    assert events[second - 1].data["finish_reason"] == "aborted"
    assert [e.type for e in events[second:]] == ["run.start", "step.done", "run.done"]
    assert events[-1].data["finish_reason"] == "stop"
    assert [e.seq for e in events] == list(range(len(events)))
    print(f"events: {[e.type for e in events]}")


def test_abort_of_a_paused_run_withdraws_its_approval_and_cancels_the_gated_call(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = _cluster(make_cluster)
    handle = cluster.client.agent(AGENT)
    approvals = handle.approvals
    session_id = fresh_id("abort-paused")
    first = ask(session_id, gate=True)
    paused = handle.send(first, session_id=session_id, check_agent=False).wait(timeout=15)
    assert paused.finish_reason == "awaiting-approval"
    (approval,) = approvals.list()
    assert approval.session_id == session_id and approval.tool_name == "gated"
    last_seq = cluster.client.read_events(session_id, -1)[-1].seq
    assert last_seq is not None

    asked = time.time()
    assert handle.abort(session_id) is True
    settled = list(handle.events(session_id, after=last_seq, timeout=15))
    took = settled[-1].at.timestamp() - asked

    assert [e.type for e in settled] == ["tool.error", "run.done"]
    assert settled[0].data["kind"] == "cancelled" and settled[0].data["tool_call_id"] == approval.tool_call_id
    assert settled[-1].data["finish_reason"] == "aborted" and settled[-1].data["approval_ids"] == []
    assert approvals.list() == []
    with pytest.raises(errors.ApprovalOrphanedError):
        approvals.resolve(approval.approval_id, approved=True)
    calls, results = _results(cluster, session_id)
    assert calls == [approval.tool_call_id]
    assert [r.get("kind") for r in results[approval.tool_call_id]] == ["cancelled"]
    checkpoint = handle.load(session_id)
    assert checkpoint is not None and checkpoint.aborted and checkpoint.approval_ids == []
    assert [p.state for p in cluster.client.pending()] == ["aborted"]
    assert _tool_log(cluster, session_id, "start") == []  # the gated call never ran
    print(
        f"paused run: aborted save {took:.3f} s after abort() (the abort's nudge runs a step at once);"
        f" approval {approval.approval_id} withdrawn and orphaned"
    )

    resumed = handle.resume(session_id)
    assert resumed is not None
    finished = resumed.wait(timeout=15)
    assert finished.finish_reason == "stop" and finished.text == HEARD + first
    assert _tool_log(cluster, session_id, "start") == []


def test_steer_mid_batch_keeps_unstarted_calls_from_starting_and_the_model_sees_the_message_next(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = _cluster(make_cluster)
    handle = cluster.client.agent(AGENT)
    session_id = fresh_id("steer")
    handle.send(ask(session_id, calls=CALLS, ms=CALL_MS), session_id=session_id, check_agent=False)
    message = "stop that and summarize instead"

    first = _first_call_started(cluster, session_id)
    asked = time.time()
    steered = handle.steer(session_id, message)
    result = steered.wait(timeout=20)

    assert result.finish_reason == "stop" and result.text == HEARD + message
    # The running call finished normally; the other two never started.
    assert [e["tool_call_id"] for e in _tool_log(cluster, session_id, "start")] == [first["tool_call_id"]]
    (ended,) = _tool_log(cluster, session_id, "end")
    assert ended["cancelled"] is False
    calls, results = _results(cluster, session_id)
    assert len(calls) == CALLS and calls[0] == first["tool_call_id"]
    assert results[calls[0]] == [{"text": f"worked {CALL_MS} ms"}]
    assert [[r.get("error") for r in results[c]] for c in calls[1:]] == [["RunRedirected"]] * (CALLS - 1)
    # The model's next turn was shown the steer as the last user message, after every result of the turn.
    model_calls = _model_calls(cluster, session_id)
    assert len(model_calls) == 2 and model_calls[-1]["last_user"] == message
    checkpoint = handle.load(session_id)
    assert checkpoint is not None and checkpoint.status == "finished"
    user_at = max(i for i, m in enumerate(checkpoint.messages) if m.role == "user")
    assert checkpoint.messages[user_at].content == message
    assert all(i < user_at for i, m in enumerate(checkpoint.messages) if m.role == "tool")

    events = cluster.client.read_events(session_id, -1)
    redirected = [e for e in events if e.type == "tool.error"]
    assert sorted(e.data["tool_call_id"] for e in redirected) == sorted(calls[1:])
    second = _start_of_input(events, 2)
    assert all(events.index(e) < second for e in redirected)
    assert [e.type for e in events[second:]] == ["run.start", "step.done", "run.done"]
    assert [e.seq for e in events] == list(range(len(events)))
    steer_s = max(e.at.timestamp() for e in redirected) - asked
    print(
        f"steer latency: redirected results saved {steer_s:.3f} s after steer(); the running call"
        f" ({CALL_MS} ms, started {asked - first['ts']:.3f} s before steer()) ended {ended['ts'] - asked:.3f} s"
        f" after it, so the save came {max(e.at.timestamp() for e in redirected) - ended['ts']:.3f} s after"
        f" the call ended"
    )
    print(f"events: {[e.type for e in events]}")
