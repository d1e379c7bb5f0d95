"""A run's durable event stream, read by consumer processes that are SIGKILLed and resumed while the run's
worker is SIGKILLed mid-batch (RELIABILITY I15): the consumers together see every event once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.support import checker
from tests.support.agents import run_input
from tests.support.cluster import ROOT, Cluster, is_alive, wait_until
from tests.support.event_consumer import READY, read_lines

#: Three tool turns of three parallel calls (the ``chaos`` agent runs up to 4 at once), then the final text.
TURNS = 4
CALLS = 3
SLEEP_MS = (500, 900)
#: Events the first consumer writes before it is killed: run.start, turn 0, two of its results.
FIRST_CONSUMER_EVENTS = 4
#: On top of I11's bound, as in ``test_kills``: two hops through Redis and a loaded 2-core machine.
SLACK_S = 2.0


@contextmanager
def _consumers() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start event consumers (``tests.support.event_consumer``) in their own process; kill any left at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start(cluster: Cluster, session_id: str, out: Path, after: int | None = None) -> subprocess.Popen[bytes]:
        args = [sys.executable, "-m", "tests.support.event_consumer", "chaos", session_id, str(out), "--timeout", "50"]
        if after is not None:
            args += ["--after", str(after)]
        with open(out.with_suffix(".log"), "ab") as log:
            process = subprocess.Popen(
                args,
                cwd=ROOT,
                env=cluster.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started.append(process)
        return process

    try:
        yield start
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)


def _epoch(at: str) -> float:
    return datetime.fromisoformat(at).timestamp()


def _turn_starts(cluster: Cluster, run_id: str, turn: int) -> list[dict[str, Any]]:
    return [
        e
        for e in cluster.events()
        if e.get("kind") == "tool"
        and e.get("phase") == "start"
        and e.get("run_id") == run_id
        and str(e.get("tool_call_id")).startswith(f"c{turn}-")
    ]


def _ended(cluster: Cluster) -> set[str]:
    return {e["exec"] for e in cluster.events() if e.get("kind") == "tool" and e.get("phase") == "end"}


def _assert_matches_transcript(union: list[dict[str, Any]], cluster: Cluster, run_id: str) -> None:
    """One tool.done per recorded result with its content, one step.done per model turn, in causal order."""
    checkpoint = cluster.client.agent("chaos").load(run_id)
    assert checkpoint is not None and checkpoint.status == "finished"
    results = {str(m.tool_call_id): m for m in checkpoint.messages if m.role == "tool"}
    turns = [m for m in checkpoint.messages if m.role == "assistant"]
    assert len(turns) == TURNS and len(results) == (TURNS - 1) * CALLS

    tool_events = [e for e in union if e["type"] in ("tool.done", "tool.error")]
    errors = [e["data"] for e in tool_events if e["type"] != "tool.done"]
    assert not errors, errors
    assert sorted(e["data"]["tool_call_id"] for e in tool_events) == sorted(results)
    for event in tool_events:
        recorded = results[event["data"]["tool_call_id"]]
        assert event["data"]["result"] == recorded.content
        assert event["data"]["tool_name"] == recorded.name == "work"

    steps = [e for e in union if e["type"] == "step.done"]
    assert [e["data"]["text"] for e in steps] == [m.content for m in turns]
    assert [[c["id"] for c in e["data"]["tool_calls"]] for e in steps] == [
        [c.id for c in m.tool_calls or ()] for m in turns
    ]
    # Each result follows the turn that asked for it, and comes before the next turn.
    asked: set[str] = set()
    for event in union:
        if event["type"] == "step.done":
            assert not asked, f"turn {event['data']['step']} saved before the results of {sorted(asked)}"
            asked = {c["id"] for c in event["data"]["tool_calls"]}
        elif event["type"] in ("tool.done", "tool.error"):
            asked.remove(event["data"]["tool_call_id"])

    done = union[-1]["data"]
    assert done["finish_reason"] == "stop" and done["text"] == checkpoint.final_text


def test_consumers_killed_and_resumed_see_every_event_once_while_a_worker_is_killed_mid_batch(
    make_cluster: Callable[..., Cluster],
) -> None:
    started_at = time.monotonic()
    cluster = make_cluster()
    # A fresh id: a run's events outlive a truncation of the run tables between tests.
    run_id = f"events-{uuid.uuid4().hex[:8]}"
    out1, out2 = cluster.workdir / "consumer-1.jsonl", cluster.workdir / "consumer-2.jsonl"

    with _consumers() as start_consumer:
        # The input waits in Postgres and its message in Redis until a worker runs: the first consumer
        # follows the run before its first event, whatever its start-up costs.
        cluster.send("chaos", run_id, run_input(run_id, turns=TURNS, calls=CALLS, sleep="{}-{}".format(*SLEEP_MS)))
        consumer1 = start_consumer(cluster, run_id, out1)
        wait_until(lambda: READY in out1.with_suffix(".log").read_text(), 20, "the first consumer to follow the run")
        first = cluster.start_worker("w1", concurrency=2)
        cluster.start_beat()
        wait_until(
            lambda: len(read_lines(out1)) >= FIRST_CONSUMER_EVENTS,
            20,
            f"the first consumer to write {FIRST_CONSUMER_EVENTS} events",
        )
        consumer1.send_signal(signal.SIGKILL)
        consumer1.wait(timeout=10)
        seen1 = read_lines(out1)
        killed_after = seen1[-1]["seq"]

        # The worker dies while every call of the next batch sleeps.
        ended = _ended(cluster)
        turn = next(
            (t for t in range(1, TURNS - 1) if not any(e["exec"] in ended for e in _turn_starts(cluster, run_id, t))),
            None,
        )
        assert turn is not None, "the run ended its last batch before the first consumer saw a few events"
        wait_until(lambda: len(_turn_starts(cluster, run_id, turn)) == CALLS, 20, f"the calls of turn {turn} to start")
        holder = cluster.holder_pid(run_id)
        assert holder is not None and holder in first.children(), f"lease {holder}, pool {first.children()}"
        fault = cluster.kill_group(first)
        assert fault.runs == (run_id,)
        ended = _ended(cluster)
        in_flight = [e["tool_call_id"] for e in _turn_starts(cluster, run_id, turn) if e["exec"] not in ended]
        assert in_flight, f"every call of turn {turn} had ended before the kill"
        wait_until(lambda: not any(is_alive(pid) for pid in fault.pids), 5, "every process of the worker to die")

        # A new consumer resumes after the last seq the first one wrote, while no worker runs.
        consumer2 = start_consumer(cluster, run_id, out2, after=killed_after)
        cluster.start_worker("w2", concurrency=2)
        workerless_s = time.time() - fault.ts
        assert consumer2.wait(timeout=45) == 0, (out2.with_suffix(".log")).read_text(errors="replace")
    cluster.wait_finished([run_id], timeout=10)

    seen2 = read_lines(out2)
    union = seen1 + seen2
    seqs = [e["seq"] for e in union]
    assert seqs == list(range(len(union))), f"consumer 1: {seqs[: len(seen1)]}, consumer 2: {seqs[len(seen1) :]}"
    types = [e["type"] for e in union]
    assert types[0] == "run.start" and types.count("run.start") == 1
    assert types[-1] == "run.done" and types.count("run.done") == 1
    assert union[0]["data"]["resumed"] is False
    # The consumers saw exactly what the run's log holds.
    stored = [
        {k: v for k, v in e.wire().items() if k in ("seq", "type", "at", "data")}
        for e in cluster.client.read_events(run_id, -1)
    ]
    assert [{k: e[k] for k in ("seq", "type", "at", "data")} for e in union] == stored
    _assert_matches_transcript(union, cluster, run_id)

    report = checker.check(cluster.database_url, cluster.log_path, expected=[run_id], faults=cluster.faults)
    checker.print_report(report, "event consumers killed and resumed, worker SIGKILLed mid-batch")
    checker.assert_clean(report)
    ttl_s = cluster.settings().lease_ttl_ms / 1000
    budget = cluster.recovery_budget(SLEEP_MS[1] / 1000, round(max(0.0, workerless_s - ttl_s) + SLACK_S, 3))
    recovery_s = report["recovery"]["max_s"]
    assert report["recovery"]["count"] == 1 and recovery_s is not None and recovery_s <= budget.limit_s

    saved_before_kill = [e["seq"] for e in union if _epoch(e["at"]) <= fault.ts]
    taken_over = next(e for e in union if _epoch(e["at"]) > fault.ts + checker.VICTIM_GRACE_S)
    print(
        f"events: {len(union)} (seq 0..{seqs[-1]}); consumer 1 saw {len(seen1)} (seq 0..{killed_after}), killed"
        f" after seq {killed_after}; consumer 2 resumed at seq {seen2[0]['seq']} and saw {len(seen2)}"
        f" (seq {seen2[0]['seq']}..{seen2[-1]['seq']})"
    )
    print(
        f"worker killed after event seq {max(saved_before_kill)}, {len(in_flight)} of {CALLS} calls of turn {turn}"
        f" running; new worker ready {workerless_s:.1f} s after the kill; first save after it"
        f" {recovery_s} s after the kill (budget {budget}); consumer 2 saw it (seq {taken_over['seq']},"
        f" {taken_over['type']}) {taken_over['seen'] - fault.ts:.2f} s after the kill"
    )
    print(
        f"raw tool re-executions: {report['raw_reexecutions']}, model calls: {report['model_calls']},"
        f" wall time {time.monotonic() - started_at:.1f} s"
    )
