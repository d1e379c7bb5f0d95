"""``once`` tools with real workers: a pool process SIGKILLed inside the tool, before or after its effect (I18).

With ``reconcile``, a call killed after its effect runs once in total and its reconciled result is recorded; killed
before it, the call runs exactly once more. Without ``reconcile`` the run waits on an approval of kind
``reconcile``, and each resolution does what it says. ``ToolContext.attempt`` counts the kill (1, then 2).
The effect is a row of the once sink (``checker.ONCE_TABLE``) naming the execution that applied it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tests.support import checker
from tests.support.agents import run_input
from tests.support.blind_reruns import ENV as BLIND_ENV
from tests.support.checker import UNCHECKED_TOOL
from tests.support.cluster import AGENTS_MODULE, Cluster, wait_until

#: Long enough for the test to read the log line and kill the process inside the sleep.
HOLD_MS = 3000


def _logged(cluster: Cluster, run_id: str, kind: str = "tool", phase: str | None = None) -> list[dict[str, Any]]:
    return [
        e
        for e in cluster.events()
        if e.get("kind") == kind and e.get("run_id") == run_id and (phase is None or e.get("phase") == phase)
    ]


def _kill_at(cluster: Cluster, run_id: str, phase: str, call_id: str | None = None) -> dict[str, Any]:
    """SIGKILL the pool process running ``run_id``'s call once it logs ``phase`` (``start`` or ``effect``)."""
    event = cluster.wait_event(
        lambda e: (
            e.get("kind") == "tool"
            and e.get("run_id") == run_id
            and e.get("phase") == phase
            and call_id in (None, e.get("tool_call_id"))
        ),
        what=f"{run_id}: a call to log {phase}",
    )
    cluster.kill_pid(int(event["pid"]))
    return event


def _result(cluster: Cluster, run_id: str, call_id: str) -> Any:
    checkpoint = cluster.client.store.load(run_id)
    assert checkpoint is not None
    (content,) = [m.content for m in checkpoint.messages if m.role == "tool" and m.tool_call_id == call_id]
    return content


def _once_sink(cluster: Cluster) -> dict[str, str]:
    import psycopg

    with psycopg.connect(cluster.database_url) as conn:
        return {str(k): str(v) for k, v in conn.execute(f"SELECT idem_key, exec FROM {checker.ONCE_TABLE}")}


def test_a_once_call_killed_inside_its_tool_is_reconciled_never_run_blindly(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster()
    cluster.start_worker(concurrency=3)
    cluster.start_beat()
    after, before, plain = "once-after", "once-before", "attempt-plain"
    cluster.send("serial", after, run_input(after, turns=2, calls="1", once="0.0", after=f"0.0:{HOLD_MS}"))
    cluster.send("serial", before, run_input(before, turns=2, calls="1", once="0.0", slow=f"0.0:{HOLD_MS}"))
    cluster.send("serial", plain, run_input(plain, turns=2, calls="2", slow=f"0.1:{HOLD_MS}"))
    killed_after = _kill_at(cluster, after, "effect")
    killed_before = _kill_at(cluster, before, "start")
    first_plain = cluster.wait_event(
        lambda e: e.get("kind") == "tool" and e.get("run_id") == plain and e.get("phase") == "end",
        what=f"{plain}: its first call to end",
    )
    killed_plain = _kill_at(cluster, plain, "start", call_id=_second_call(cluster, plain))
    cluster.wait_finished([after, before, plain], timeout=60)

    report = checker.check(
        cluster.database_url, cluster.log_path, expected=[after, before, plain], faults=cluster.faults
    )
    checker.print_report(report, "once calls SIGKILLed inside the tool")
    checker.assert_clean(report)
    sink = _once_sink(cluster)

    # Killed after its effect: one execution in all; reconcile found the effect, and its answer is the result
    call = str(killed_after["tool_call_id"])
    assert [e["exec"] for e in _logged(cluster, after, phase="start")] == [killed_after["exec"]]
    assert sink[call] == killed_after["exec"]
    [reconciled] = _logged(cluster, after, kind="reconcile")
    assert (reconciled["found"], reconciled["attempt"]) == (killed_after["exec"], 2)
    assert json.loads(_result(cluster, after, call)) == {"exec": killed_after["exec"], "reconciled": True}

    # Killed before its effect: reconcile found nothing, the call ran exactly once more, as attempt 2
    call = str(killed_before["tool_call_id"])
    starts = _logged(cluster, before, phase="start")
    assert [e["attempt"] for e in starts] == [1, 2] and starts[0]["exec"] == killed_before["exec"]
    assert [e["found"] for e in _logged(cluster, before, kind="reconcile")] == [None]
    assert sink[call] == starts[1]["exec"]
    assert json.loads(_result(cluster, before, call))["exec"] == starts[1]["exec"]

    # A plain call killed mid-call runs again (at least once), and knows it: attempt 2; the call before it ran once
    starts = _logged(cluster, plain, phase="start")
    assert [(e["tool_call_id"] == first_plain["tool_call_id"], e["attempt"]) for e in starts] == [
        (True, 1),
        (False, 1),
        (False, 2),
    ]
    assert starts[1]["exec"] == killed_plain["exec"]
    events = [e.data for e in cluster.client.read_events(after, -1) if e.type == "tool.reconcile"]
    assert [(e["outcome"], e["by"]) for e in events] == [("happened", "reconcile")]
    print(
        f"reconciled {report['reconciled_results']}, once re-executions after an effect"
        f" {report['once_reexecutions']}, recovery max {report['recovery']['max_s']} s"
    )


def _second_call(cluster: Cluster, run_id: str) -> str:
    """The id of the second call of ``run_id``'s first tool turn, once it started."""
    event = cluster.wait_event(
        lambda e: (
            e.get("kind") == "tool"
            and e.get("run_id") == run_id
            and e.get("phase") == "start"
            and str(e.get("tool_call_id", "")).startswith("c0-1-")
        ),
        what=f"{run_id}: its second call to start",
    )
    return str(event["tool_call_id"])


def test_without_reconcile_a_person_decides_each_interrupted_call(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster()
    cluster.start_worker(concurrency=3)
    cluster.start_beat()
    again, not_done, answered = "ask-again", "ask-not-done", "ask-answered"
    cluster.send("serial", again, run_input(again, turns=2, calls="1", unchecked="0.0", slow=f"0.0:{HOLD_MS}"))
    cluster.send("serial", not_done, run_input(not_done, turns=2, calls="1", unchecked="0.0", slow=f"0.0:{HOLD_MS}"))
    cluster.send("serial", answered, run_input(answered, turns=2, calls="1", unchecked="0.0", after=f"0.0:{HOLD_MS}"))
    killed = {
        again: _kill_at(cluster, again, "start"),
        not_done: _kill_at(cluster, not_done, "start"),
        answered: _kill_at(cluster, answered, "effect"),
    }
    runs = list(killed)
    wait_until(
        lambda: (
            all(s["status"] == "awaiting-approval" for s in cluster.statuses(runs).values())
            and len(cluster.statuses(runs)) == 3
        ),
        40,
        "the three runs to wait on a person",
    )
    approvals = cluster.client.agent("serial").approvals
    asked = {a.session_id: a for a in approvals.list()}
    assert {run: (a.kind, a.tool_name) for run, a in asked.items()} == {
        run: ("reconcile", UNCHECKED_TOOL) for run in runs
    }
    assert [p.approval_kind for p in cluster.client.agent("serial").pending()] == ["reconcile"] * 3

    approvals.resolve(asked[again].approval_id, approved=True, note="it never reached the bank")
    approvals.resolve(asked[not_done].approval_id, approved=False, note="dropped: the customer cancelled")
    approvals.resolve(asked[answered].approval_id, answer="charged; seen on the dashboard")
    cluster.wait_finished(runs, timeout=40)

    report = checker.check(cluster.database_url, cluster.log_path, expected=runs, faults=cluster.faults)
    checker.print_report(report, "once calls without reconcile, decided by a person")
    checker.assert_clean(report)
    sink = _once_sink(cluster)
    calls = {run: str(event["tool_call_id"]) for run, event in killed.items()}
    # Approved: it ran again (attempt 2), and that execution's effect and result are the only ones
    starts = _logged(cluster, again, phase="start")
    assert [e["attempt"] for e in starts] == [1, 2]
    assert sink[calls[again]] == starts[1]["exec"] == json.loads(_result(cluster, again, calls[again]))["exec"]
    # Rejected: recorded as not done with the note, never run again, no effect
    body = json.loads(_result(cluster, not_done, calls[not_done]))
    assert (body["kind"], body["note"]) == ("not-done", "dropped: the customer cancelled")
    assert len(_logged(cluster, not_done, phase="start")) == 1 and calls[not_done] not in sink
    # Answered: the answer is the result; the one execution's effect stands
    assert _result(cluster, answered, calls[answered]) == "charged; seen on the dashboard"
    assert len(_logged(cluster, answered, phase="start")) == 1
    assert sink[calls[answered]] == killed[answered]["exec"]


def test_negative_control_a_build_that_runs_once_calls_again_blindly_trips_the_checker(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": f"{AGENTS_MODULE},tests.support.blind_reruns", BLIND_ENV: "1"})
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    run_id = "blind"
    cluster.send("serial", run_id, run_input(run_id, turns=2, calls="1", once="0.0", after=f"0.0:{HOLD_MS}"))
    _kill_at(cluster, run_id, "effect")
    cluster.wait_finished([run_id], timeout=40)
    report = checker.check(cluster.database_url, cluster.log_path, expected=[run_id], faults=cluster.faults)
    checker.print_report(report, "negative control: once calls run again blindly")
    assert report["checks"]["I18"] == "fail" and report["once_reexecutions"] == 1, report["violations"]
    print(f"the checker saw it: {[v for v in report['violations'] if v.startswith('I18')]}")
