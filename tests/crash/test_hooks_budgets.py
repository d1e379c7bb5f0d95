"""Hooks, budgets and dynamic agents with real ``celery worker`` processes on the real services: hooks that deny,
rewrite and replace; a raising hook that parks the run across a worker restart until the fix; a hook refused the
arguments a person approved; ``on_run_end`` delivered again after a crash before its note; a budget stop the
sweep leaves alone until a resume raises it; and a dynamic agent that keeps its chosen model across a kill."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from store import errors
from store.limits import Limits
from store.records import Checkpoint, Message
from tests.support import checker
from tests.support.agents import run_input
from tests.support.checker import Fault
from tests.support.cluster import Cluster, fresh_id, wait_until
from tests.support.hook_agents import (
    ANSWERED_BY,
    DENY_REASON,
    ENDING,
    FRAGILE,
    GUARDED,
    GUARDED_CALLS,
    HOOK_DIR_ENV,
    METERED,
    METERED_TOOL_TURNS,
    OUTPUT_LIMIT,
    PINNED,
    REDACTED,
    REFUND_ARGS,
    TIERED,
    TIERS,
    TURN_USAGE,
    ends_file,
    received_args,
    switch_file,
    tier_file,
)

MODULE = "tests.support.hook_agents"
#: The crash point between the ``on_run_end`` hooks and the note that they ran (``worker/steps.py``).
END_POINT = "after_end_hooks_before_note"
#: Recover sweeps the workers must receive, after the stopped run went quiet for a lease TTL, without moving it.
SWEEPS = 3


def _cluster(make_cluster: Callable[..., Cluster], tmp_path: Path, crash_at: str = "") -> tuple[Cluster, Path]:
    """A cluster running this module's agents, one worker of one pool process, and the shared directory."""
    shared = tmp_path / "shared"
    shared.mkdir(exist_ok=True)
    cluster = make_cluster(crash_at=crash_at, extra_env={"LOUSHO_AGENTS": MODULE, HOOK_DIR_ENV: str(shared)})
    cluster.start_worker(concurrency=1)
    return cluster, shared


def _calls(checkpoint: Checkpoint) -> list[tuple[str, dict[str, Any]]]:
    """(call id, arguments as the model gave them) of every call in the transcript."""
    return [(c.id, dict(c.args)) for m in checkpoint.messages if m.role == "assistant" for c in m.tool_calls or ()]


def _results(checkpoint: Checkpoint) -> dict[str, Message]:
    """Call id -> its saved result message."""
    return {str(m.tool_call_id): m for m in checkpoint.messages if m.role == "tool"}


def _status(cluster: Cluster, session_id: str) -> dict[str, Any]:
    return cluster.statuses([session_id]).get(session_id, {})


def _end_due(cluster: Cluster, session_id: str) -> bool:
    with psycopg.connect(cluster.database_url) as conn:
        row = conn.execute("SELECT end_due FROM runs WHERE session_id = %s", (session_id,)).fetchone()
    assert row is not None
    return bool(row[0])


def _assert_checked(cluster: Cluster, session_id: str, title: str, faults: Iterable[Fault] | None = None) -> None:
    """The checker finds nothing wrong with the run (results a hook gave without running the call included)."""
    report = checker.check(
        cluster.database_url,
        cluster.log_path,
        expected=[session_id],
        faults=list(cluster.faults if faults is None else faults),
    )
    checker.print_report(report, title)
    left = report["violations"]
    assert not left, f"{len(left)} violation(s):\n" + "\n".join(left[:20])


def test_hooks_deny_one_call_rewrite_another_and_replace_a_third_result_with_a_real_worker(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster, shared = _cluster(make_cluster, tmp_path)
    session_id = fresh_id("guarded")
    result = (
        cluster.client.agent(GUARDED)
        .send(run_input(session_id), session_id=session_id, check_agent=False)
        .wait(timeout=20)
    )
    assert result.finish_reason == "stop" and str(result.text).startswith("recorded")

    checkpoint = cluster.checkpoint(GUARDED, session_id)
    calls = _calls(checkpoint)
    # The transcript keeps the model's own arguments, whatever the hooks made of them.
    assert [args for _, args in calls] == list(GUARDED_CALLS)
    (denied_id, _), (rewritten_id, _), (replaced_id, _) = calls
    # The denied call never ran; the rewritten one ran with the hook's arguments; the third with the model's.
    assert [{k: v for k, v in a.items() if k != "call"} for a in received_args(shared, session_id)] == [
        {"order": "A2", "amount": 20},
        {"order": "a3", "amount": 5},
    ]
    assert [a["call"] for a in received_args(shared, session_id)] == [rewritten_id, replaced_id]
    assert cluster.call_starts(session_id) == Counter({rewritten_id: 1, replaced_id: 1})

    results = _results(checkpoint)
    assert list(results) == [denied_id, rewritten_id, replaced_id]
    denied = results[denied_id]
    assert denied.is_error and json.loads(str(denied.content))["kind"] == "denied"
    assert DENY_REASON in json.loads(str(denied.content))["message"]
    rewritten = json.loads(str(results[rewritten_id].content))
    assert (rewritten["order"], results[rewritten_id].replaced_by_hook) == ("A2", None)
    replaced = json.loads(str(results[replaced_id].content))
    assert replaced["order"] == REDACTED and results[replaced_id].replaced_by_hook is True
    done = {e.data["tool_call_id"]: e for e in cluster.client.read_events(session_id, -1) if e.type == "tool.done"}
    assert done[replaced_id].data["replaced_by_hook"] is True
    _assert_checked(cluster, session_id, "hooks deny, rewrite and replace")


def test_a_raising_hook_parks_the_run_across_a_worker_restart_and_resume_after_the_fix_finishes_it(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster, shared = _cluster(make_cluster, tmp_path)
    handle = cluster.client.agent(FRAGILE)
    session_id = fresh_id("fragile")
    switch = switch_file(shared, session_id)
    switch.touch()
    run = handle.send(run_input(session_id), session_id=session_id, check_agent=False)

    # By its code: ``Run.wait`` rebuilds the error through ``errors.from_record``.
    with pytest.raises(errors.LoushoError) as raised:
        run.wait(timeout=20)
    assert raised.value.code == errors.HookFailedError.code
    (pending,) = handle.pending()
    assert (pending.session_id, pending.state) == (session_id, "parked")
    assert pending.last_error is not None and pending.last_error.code == errors.HookFailedError.code
    assert "Audit.pre_tool_call" in pending.last_error.message
    checkpoint = cluster.checkpoint(FRAGILE, session_id)
    ((call_id, _),) = _calls(checkpoint)
    assert checkpoint.status == "in-progress" and _results(checkpoint) == {}  # the turn is kept, no result
    assert cluster.call_starts(session_id) == Counter()

    # Nothing of the failure lives in the worker: it dies, a new one starts, the run is still parked.
    (first,) = cluster.live_workers()
    cluster.kill_group(first)
    second = cluster.start_worker(name="w2", concurrency=1)
    parked = _status(cluster, session_id)
    assert parked["status"] == "in-progress" and parked["last_error"]["code"] == errors.HookFailedError.code

    switch.unlink()  # the fix
    resumed = handle.resume(session_id)
    assert resumed is not None
    result = resumed.wait(timeout=20)
    assert result.finish_reason == "stop" and str(result.text).startswith("tally ok")
    assert handle.pending() == []
    assert cluster.call_starts(session_id) == Counter({call_id: 1})  # the call ran once, after the fix
    body = json.loads(str(_results(cluster.checkpoint(FRAGILE, session_id))[call_id].content))
    assert body["pid"] in second.children()
    _assert_checked(cluster, session_id, "raising hook, worker restart, resume after the fix")


def test_a_hook_cannot_change_the_arguments_a_person_approved(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster, shared = _cluster(make_cluster, tmp_path)
    handle = cluster.client.agent(PINNED)
    session_id = fresh_id("pinned")
    paused = handle.send(run_input(session_id), session_id=session_id, check_agent=False).wait(timeout=20)
    assert paused.finish_reason == "awaiting-approval"
    (approval,) = handle.approvals.list()
    assert (approval.session_id, approval.tool_name, approval.args) == (session_id, "refund", REFUND_ARGS)

    result = handle.approvals.resolve(approval.approval_id, approved=True).wait(timeout=20)

    assert result.finish_reason == "stop" and str(result.text).startswith("refund validation")
    checkpoint = cluster.checkpoint(PINNED, session_id)
    refused = _results(checkpoint)[approval.tool_call_id]
    body = json.loads(str(refused.content))
    assert refused.is_error and (body["kind"], body["error"]) == ("validation", "ApprovedArgsChanged")
    assert received_args(shared, session_id) == []  # the tool never ran, neither arguments reached it
    assert cluster.call_starts(session_id) == Counter()
    assert _calls(checkpoint) == [(approval.tool_call_id, REFUND_ARGS)]
    _assert_checked(cluster, session_id, "hook refused the approved arguments")


def test_on_run_end_runs_again_with_the_same_end_id_after_a_crash_before_its_note(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    prefix = "ending-"
    cluster, shared = _cluster(make_cluster, tmp_path, crash_at=f"{END_POINT}:{prefix}")
    cluster.start_beat()
    session_id = fresh_id("ending")
    result = (
        cluster.client.agent(ENDING)
        .send(run_input(session_id), session_id=session_id, check_agent=False)
        .wait(timeout=20)
    )
    assert result.finish_reason == "stop"

    ends = ends_file(shared, session_id)
    wait_until(
        lambda: ends.exists() and len(ends.read_text().splitlines()) >= 2, 20, "on_run_end delivered a second time"
    )
    wait_until(lambda: not _end_due(cluster, session_id), 10, "the note that the end hooks ran")
    marker = cluster.crash_dir / f"crash-{END_POINT}-{session_id}"
    assert marker.exists(), "the crash point did not fire"
    crashed = int(marker.read_text())
    checkpoint = cluster.checkpoint(ENDING, session_id)
    end_id = f"{session_id}:{checkpoint.seq}"
    assert ends.read_text().splitlines() == [end_id, end_id]
    delivered = [e for e in cluster.events() if e.get("kind") == "run_end" and e.get("run_id") == session_id]
    assert [e["pid"] == crashed for e in delivered] == [True, False]  # delivered again by another process
    time.sleep(cluster.settings().recover_interval_s * 2)  # later sweeps owe it nothing more
    assert len(ends.read_text().splitlines()) == 2 and not _end_due(cluster, session_id)
    logs = cluster.worker_logs()
    assert "recover: re-enqueued" in logs or f"step of {session_id} sent again: the pool process" in logs, (
        "the second delivery came neither from the sweep nor from the worker that saw its process die"
    )
    fault = Fault(marker.stat().st_mtime, f"crash:{END_POINT}", (crashed,), (session_id,))
    _assert_checked(cluster, session_id, "on_run_end across a crash before its note", faults=[fault])


def test_a_budget_stop_is_left_alone_by_the_sweep_and_a_resume_with_a_raised_limit_finishes_the_run(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster, _ = _cluster(make_cluster, tmp_path)
    cluster.start_beat()
    settings = cluster.settings()
    handle = cluster.client.agent(METERED)
    session_id = fresh_id("metered")

    stopped = handle.send(run_input(session_id), session_id=session_id, check_agent=False).wait(timeout=20)

    # Checked before each model call: after 3 turns of 40 output tokens the limit of 100 is spent.
    turns = -(-OUTPUT_LIMIT // TURN_USAGE["output_tokens"])
    assert stopped.finish_reason == "budget-exceeded" and stopped.steps == turns
    assert stopped.usage.output_tokens == turns * TURN_USAGE["output_tokens"]
    assert cluster.checkpoint(METERED, session_id).status == "in-progress"
    assert [p.session_id for p in handle.pending()] == [session_id]
    events = cluster.client.read_events(session_id, -1)
    done = events[-1]
    assert done.type == "run.done" and done.data["finish_reason"] == "budget-exceeded"

    # The sweep runs on and leaves the run alone: quiet for a lease TTL, then several sweeps later still there.
    seq = _status(cluster, session_id)["seq"]
    _, received = cluster.sweeps()
    quiet_until = done.at.timestamp() + settings.lease_ttl_ms / 1000
    wait_until(
        lambda: time.time() > quiet_until and cluster.sweeps()[1] >= received + SWEEPS,
        10 + SWEEPS * settings.recover_interval_s,
        f"{SWEEPS} sweeps after the stopped run went quiet",
    )
    assert _status(cluster, session_id)["seq"] == seq
    assert [e.seq for e in cluster.client.read_events(session_id, -1)] == [e.seq for e in events]
    assert len(cluster.model_starts(session_id)) == turns
    print(f"sweeps received while the budget-stopped run sat still: {cluster.sweeps()[1] - received}, seq {seq}")

    resumed = handle.resume(session_id, limits=Limits(max_output_tokens=OUTPUT_LIMIT * 10))
    assert resumed is not None
    finished = resumed.wait(timeout=20)
    assert finished.finish_reason == "stop" and str(finished.text).startswith("all done")
    assert finished.steps == METERED_TOOL_TURNS + 1
    assert len(cluster.model_starts(session_id)) == METERED_TOOL_TURNS + 1
    _assert_checked(cluster, session_id, "budget stop, resume with a raised limit")


def test_a_dynamic_agent_killed_mid_run_resumes_with_the_model_it_chose_not_the_one_resolve_picks_now(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster, shared = _cluster(make_cluster, tmp_path)
    cluster.start_beat()
    session_id = fresh_id("tiered")
    tier = tier_file(shared, session_id)
    tier.write_text("fast")
    cluster.send(TIERED, session_id, run_input(session_id))

    started = cluster.wait_event(
        lambda e: e.get("kind") == "tool" and e.get("phase") == "start" and e.get("run_id") == session_id,
        what="the slow call to start",
    )
    (first,) = cluster.live_workers()
    fault = cluster.kill_group(first)
    assert fault.runs == (session_id,), "the killed worker did not hold the run"
    tier.write_text("smart")  # what resolve chooses from now on
    cluster.start_worker(name="w2", concurrency=1)
    cluster.wait_finished([session_id], timeout=30)

    checkpoint = cluster.checkpoint(TIERED, session_id)
    assert checkpoint.finish_reason == "stop"
    assert str(checkpoint.final_text).startswith(f"{ANSWERED_BY}fast")
    assert checkpoint.run_config is not None and checkpoint.run_config["model"]["model_id"] == TIERS["fast"]
    # resolve ran again after the kill and would have chosen the other model; the saved choice won.
    later = [
        e["tier"]
        for e in cluster.events()
        if e.get("kind") == "resolve" and e.get("run_id") == session_id and e["ts"] > fault.ts
    ]
    assert later and set(later) == {"smart"}
    assert cluster.call_starts(session_id) == Counter({str(started["tool_call_id"]): 2})  # killed once, then ran
    _assert_checked(cluster, session_id, "dynamic agent killed mid-run")
