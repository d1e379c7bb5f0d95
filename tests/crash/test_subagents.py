"""Sub-agents as child runs on real ``celery worker`` processes: a worker killed while two children run repeats
nothing they recorded, an approval inside a child decided from another process after a restart finishes child and
lead, a lead deleted while its tool runs starts no child, and the fan-out figure (a lead's eight children against
as many independent runs on two workers)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from store.records import Checkpoint, Usage
from tests.support import checker
from tests.support.agents import run_input
from tests.support.cluster import Cluster, Worker, fresh_id, wait_until
from tests.support.subagent_agents import (
    CHILD,
    CHILD_USAGE,
    EDITOR,
    FAN,
    FAN_CHILDREN,
    FAN_LEAD,
    LEAD,
    LEAD_USAGE,
    SLOW_LEAD,
)

MODULE = "tests.support.subagent_agents"
ROOT = Path(__file__).resolve().parents[2]
#: A ``work`` call in flight younger than this is killed well before it ends (the calls sleep 0.9-1.3 s).
IN_FLIGHT_S = 0.5
#: Recover sweeps the new workers must receive while the approval waits, without either run moving.
SWEEPS = 2


def _cluster(make_cluster: Callable[..., Cluster], workers: int) -> Cluster:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": MODULE})
    for n in range(1, workers + 1):
        cluster.start_worker(name=f"w{n}", concurrency=1)
    cluster.start_beat()
    return cluster


def _calls(checkpoint: Checkpoint) -> list[str]:
    """Every call id the model asked for, in order."""
    return [c.id for m in checkpoint.messages if m.role == "assistant" for c in m.tool_calls or ()]


def _results(checkpoint: Checkpoint) -> Counter[str]:
    """How many results each call has."""
    return Counter(str(m.tool_call_id) for m in checkpoint.messages if m.role == "tool")


def _turns(checkpoint: Checkpoint) -> int:
    return sum(1 for m in checkpoint.messages if m.role == "assistant")


def _times(usage: dict[str, int], turns: int) -> Usage:
    return Usage(
        input_tokens=usage["input_tokens"] * turns,
        output_tokens=usage["output_tokens"] * turns,
        total_tokens=(usage["input_tokens"] + usage["output_tokens"]) * turns,
    )


def _children(cluster: Cluster, agent: str, lead: str, count: int) -> list[str]:
    """The lead's child runs, in the order of its calls, once its step saved that it delegated ``count`` calls."""

    def delegated() -> bool:
        checkpoint = cluster.client.agent(agent).load(lead)
        return checkpoint is not None and len(checkpoint.delegated or {}) == count

    wait_until(delegated, 20, f"{lead} to delegate {count} calls")
    checkpoint = cluster.checkpoint(agent, lead)
    by_call = checkpoint.delegated or {}
    return [by_call[call_id] for call_id in _calls(checkpoint)]


def _runs_under(cluster: Cluster, lead: str) -> list[str]:
    """Every stored run whose id names ``lead`` as its lead."""
    with psycopg.connect(cluster.database_url) as conn:
        rows = conn.execute(
            "SELECT session_id FROM runs WHERE starts_with(session_id, %s) ORDER BY 1", (lead + ".task-",)
        ).fetchall()
    return [row[0] for row in rows]


def _tool_starts(cluster: Cluster) -> Counter[str]:
    """How many times each call id started executing, in any run (a child started again asks the same ids)."""
    return Counter(
        str(e["tool_call_id"]) for e in cluster.events() if e.get("kind") == "tool" and e.get("phase") == "start"
    )


def _in_flight(cluster: Cluster, session_id: str, younger_than: float) -> dict[str, Any] | None:
    """The run's ``work`` call that started less than ``younger_than`` s ago and has not ended, if any."""
    events = [e for e in cluster.events() if e.get("kind") == "tool" and e.get("run_id") == session_id]
    ended = {e["exec"] for e in events if e["phase"] == "end"}
    now = time.time()
    running = [e for e in events if e["phase"] == "start" and e["exec"] not in ended and now - e["ts"] < younger_than]
    return running[-1] if running else None


def _worker_of(cluster: Cluster, session_id: str) -> Worker:
    """The live worker whose pool process holds the run's lease."""
    pid = cluster.holder_pid(session_id)
    (worker,) = [w for w in cluster.live_workers() if pid == w.pid or pid in w.children()]
    return worker


def _assert_checked(cluster: Cluster, runs: Sequence[str], title: str) -> None:
    report = checker.check(cluster.database_url, cluster.log_path, expected=runs, faults=cluster.faults)
    checker.print_report(report, title)
    checker.assert_clean(report)


def test_a_worker_killed_while_two_children_run_repeats_nothing_they_recorded(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = _cluster(make_cluster, workers=2)
    lead_id = fresh_id("lead")
    cluster.send(LEAD, lead_id, run_input(lead_id))
    children = _children(cluster, LEAD, lead_id, 2)

    # Both children run (one per worker), each with a result recorded and a young ``work`` call in flight.
    def both_mid_call() -> bool:
        return all(_results(cluster.checkpoint(CHILD, c)) and _in_flight(cluster, c, IN_FLIGHT_S) for c in children)

    wait_until(both_mid_call, 20, "both children to record a result and be in the middle of a call")
    recorded = {c: set(_results(cluster.checkpoint(CHILD, c))) for c in children}
    victim_run = children[0]
    interrupted = _in_flight(cluster, victim_run, IN_FLIGHT_S + 0.2)
    assert interrupted is not None
    fault = cluster.kill_group(_worker_of(cluster, victim_run))
    assert victim_run in fault.runs
    cluster.start_worker(name="w3", concurrency=1)
    cluster.wait_finished([lead_id, *children], timeout=40)

    # Nothing a child recorded before the kill ran again; the call the kill cut short ran again, once.
    starts = _tool_starts(cluster)
    again = {call: starts[call] for c in children for call in recorded[c] if starts[call] != 1}
    assert not again, f"recorded before the kill, then run again: {again}"
    assert starts[interrupted["tool_call_id"]] == 2
    # The lead has exactly the two children it named before the kill, and every call of every run one result.
    assert _runs_under(cluster, lead_id) == sorted(children)
    lead = cluster.checkpoint(LEAD, lead_id)
    done = [e.data["child_run_id"] for e in cluster.client.read_events(lead_id, -1) if e.type == "subagent.done"]
    assert sorted(done) == sorted(children)
    finished = {c: cluster.checkpoint(CHILD, c) for c in children}
    # Each child is the run the lead's model named when it asked (ids derived from lead, step and call):
    # every turn of the child was generated under that id.
    for child_id, child in finished.items():
        logged = {m["turn_index"] for m in cluster.model_starts(child_id)}
        assert logged == set(range(_turns(child))), child_id
    for checkpoint in [lead, *finished.values()]:
        assert _results(checkpoint) == Counter(_calls(checkpoint)), checkpoint.session_id
    # Each child's final text is its call's result; the lead's usage is its own turns' plus its children's.
    results = [str(m.content) for m in lead.messages if m.role == "tool"]
    assert [r.split("\n")[0] for r in results] == [finished[c].final_text for c in children]
    for child in finished.values():
        assert child.usage == _times(CHILD_USAGE, _turns(child)), child.session_id
    own = _times(LEAD_USAGE, len(cluster.model_starts(lead_id)))
    assert _turns(lead) == len(cluster.model_starts(lead_id)) == 2
    assert lead.usage == own + finished[children[0]].usage + finished[children[1]].usage
    _assert_checked(cluster, [lead_id, *children], "sub-agents: a worker killed while two children run")


def test_an_approval_inside_a_child_decided_from_another_process_after_a_restart_finishes_child_and_lead(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = _cluster(make_cluster, workers=2)
    lead_id = fresh_id("editor")
    run = cluster.client.agent(EDITOR).send(run_input(lead_id), session_id=lead_id, check_agent=False)
    paused = run.wait(timeout=30)
    (child_id,) = _children(cluster, EDITOR, lead_id, 1)

    (approval,) = cluster.client.approvals.list()
    assert (approval.session_id, approval.tool_name, approval.run_path) == (
        child_id,
        checker.APPROVED_TOOL,
        [lead_id, child_id],
    )
    assert paused.finish_reason == "awaiting-approval" and paused.approval_ids == [approval.approval_id]
    child = cluster.checkpoint(CHILD, child_id)
    assert child.status == "awaiting-approval" and child.approval_ids == [approval.approval_id]
    (work_id, gated_id) = _calls(child)
    assert cluster.call_starts(child_id) == Counter({work_id: 1})  # the ordinary call ran; the gated one waits

    # Every worker dies; new ones start, and their sweeps leave both paused runs as they are.
    for worker in cluster.live_workers():
        cluster.kill_group(worker)
    cluster.start_worker(name="w3", concurrency=1)
    cluster.start_worker(name="w4", concurrency=1)
    before = cluster.statuses([lead_id, child_id])
    _, received = cluster.sweeps()
    wait_until(lambda: cluster.sweeps()[1] >= received + SWEEPS, 15, f"{SWEEPS} sweeps by the new workers")
    assert cluster.statuses([lead_id, child_id]) == before
    assert {s["status"] for s in before.values()} == {"awaiting-approval"}

    # A person approves through the command line, another OS process.
    approved = subprocess.run(
        [sys.executable, "-m", "producer.cli", "approvals", "approve", approval.approval_id, "--json"],
        cwd=ROOT,
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert approved.returncode == 0, approved.stderr
    assert json.loads(approved.stdout)["session_id"] == child_id
    cluster.wait_finished([lead_id, child_id], timeout=30)

    starts = [e for e in cluster.events() if e.get("kind") == "tool" and e.get("phase") == "start"]
    assert [(e["run_id"], e["tool_call_id"], e["approved"]) for e in starts] == [
        (child_id, work_id, False),
        (child_id, gated_id, True),
    ]  # the approved call ran once, after the decision
    lead = cluster.checkpoint(EDITOR, lead_id)
    child = cluster.checkpoint(CHILD, child_id)
    assert lead.approval_ids == [] and cluster.client.approvals.list() == []
    assert child.final_text is not None and lead.final_text is not None
    assert child.final_text.split(" [resp:")[0] in lead.final_text
    _assert_checked(cluster, [lead_id, child_id], "sub-agents: an approval inside a child, decided after a restart")


def _steps_logged(cluster: Cluster, session_id: str) -> int:
    """How many steps of the run the workers ended (their ``advance <id> seq=... -> outcome`` lines)."""
    return cluster.worker_logs().count(f"advance {session_id} seq=")


def test_a_lead_deleted_while_its_tool_runs_starts_no_child(make_cluster: Callable[..., Cluster]) -> None:
    cluster = _cluster(make_cluster, workers=1)
    lead_id = fresh_id("slow")
    cluster.send(SLOW_LEAD, lead_id, run_input(lead_id))
    cluster.wait_event(
        lambda e: e.get("kind") == "tool" and e.get("run_id") == lead_id and e["phase"] == "start", timeout=20
    )
    steps_before = _steps_logged(cluster, lead_id)

    # Deleted by this process while a worker runs its ``work`` call; the ``task`` call comes after it in the batch.
    assert cluster.client.agent(SLOW_LEAD).delete(lead_id)
    cluster.wait_event(
        lambda e: e.get("kind") == "tool" and e.get("run_id") == lead_id and e["phase"] == "end", timeout=20
    )
    wait_until(lambda: _steps_logged(cluster, lead_id) > steps_before, 20, "the lead's batch to end")

    assert _runs_under(cluster, lead_id) == []
    assert [e for e in cluster.events() if e.get("kind") == "model" and e["run_id"].startswith(lead_id + ".")] == []
    assert cluster.statuses([lead_id]) == {}


@pytest.mark.timeout(40)
def test_the_fan_out_figure_a_lead_with_eight_children_against_independent_runs(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = _cluster(make_cluster, workers=2)
    warm = [fresh_id("warm") for _ in range(2)]
    for run_id in warm:
        cluster.send(CHILD, run_id, run_input(run_id, turns=2, calls=1, sleep=50))
    cluster.wait_finished(warm, timeout=20)

    alone = [fresh_id("alone") for _ in range(FAN_CHILDREN)]
    started = time.monotonic()
    for run_id in alone:
        cluster.send(CHILD, run_id, run_input(run_id, **FAN))
    cluster.wait_finished(alone, timeout=30)
    alone_s = time.monotonic() - started

    lead_id = fresh_id("fan")
    started = time.monotonic()
    cluster.send(FAN_LEAD, lead_id, run_input(lead_id))
    cluster.wait_finished([lead_id], timeout=30)
    lead_s = time.monotonic() - started

    children = _runs_under(cluster, lead_id)
    assert len(children) == FAN_CHILDREN
    assert {s["status"] for s in cluster.statuses(children).values()} == {"finished"}
    lead = cluster.checkpoint(FAN_LEAD, lead_id)
    assert len(_results(lead)) == FAN_CHILDREN and lead.finish_reason == "stop"
    steps = FAN_CHILDREN * (int(str(FAN["turns"])) - 1)
    print(
        f"\nfan-out: a lead with {FAN_CHILDREN} children of {steps // FAN_CHILDREN} tool steps"
        f" ({FAN['sleep']} ms each) {lead_s:.2f} s; {steps} independent steps ({FAN_CHILDREN} runs)"
        f" {alone_s:.2f} s; ratio {lead_s / alone_s:.2f} (2 workers, concurrency 1)"
    )
