"""Flower shows runs: a real worker and beat, Flower, and a headless Chromium reading Flower's tasks page.

Three runs (``tests.support.flower_agents``): one finishes after a tool batch, one parks on a tool that stops it
for good, one is recorded for a retry once and then finishes. Typing a run's id into the search box of the
tasks page must list that run's steps, each named ``<agent>: <kind>`` with the run id and seq as keyword
arguments and a short result; the step that parked the run shows FAILURE, the one recorded for a retry
RETRY; the sweeps the beat sends every second never show; no prompt, tool argument or output shows anywhere.
Every task event of a step, the sender's task-sent included, carries the step's name, checked on the raw events
(a late task-sent named ``lousho.advance`` would rename the row, which the page shows only when events race).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from store import telemetry
from tests.support import flower_agents as agents
from tests.support.cluster import Cluster, fresh_id, wait_until
from tests.support.flower_ui import CHROMIUM, PASSWORD, USER, EventTap, FlowerProcess, TasksPage, missing_prerequisite

FINAL_STATES = {"SUCCESS", "FAILURE", "RETRY"}
#: A step's result is a summary ("model turn: 2 tool calls"), never a transcript.
RESULT_MAX = 120


@pytest.fixture
def flower_and_browser(make_cluster: Callable[..., Cluster]) -> Iterator[tuple[Cluster, FlowerProcess, EventTap, Any]]:
    """A cluster on the Flower agents, Flower (not started), a tap on the raw events and a Playwright browser."""
    problem = missing_prerequisite()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)
    from playwright.sync_api import sync_playwright

    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": "tests.support.flower_agents"})
    flower = FlowerProcess(cluster.env(), cluster.workdir / "flower.log")
    tap = EventTap()
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
            context = browser.new_context(
                http_credentials={"username": USER, "password": PASSWORD}, viewport={"width": 2400, "height": 1200}
            )
            try:
                yield cluster, flower, tap, context
            finally:
                context.close()
                browser.close()
    finally:
        # Its log stays in the cluster's work dir, which the crash fixtures keep when the test fails.
        flower.close()
        tap.close()


def _is_parked(cluster: Cluster, run_id: str) -> bool:
    error = cluster.statuses([run_id]).get(run_id, {}).get("last_error") or {}
    return error.get("retryable") is False


def _steps(page: TasksPage, run_id: str, timeout: float = 10.0) -> list[dict[str, str]]:
    """The rows shown for ``run_id`` once every one is in a final state, oldest first.

    The run settled before the page is read, so its steps' events are sent; the table does not refresh by
    itself, so a step whose last event came after the search shows on a reload.
    """
    page.search(run_id)
    deadline = time.monotonic() + timeout
    rows = page.rows()
    while not rows or any(row.get("state") not in FINAL_STATES for row in rows):
        if time.monotonic() > deadline:
            break
        time.sleep(0.3)
        page.refresh()
        rows = page.rows()
    return sorted(rows, key=lambda row: row.get("received", ""))


def _kind(row: dict[str, str], agent: str) -> str:
    name = row.get("name", "")
    assert name.startswith(f"{agent}: "), f"step not named for its agent {agent!r}: {row}"
    kind = name.removeprefix(f"{agent}: ")
    assert kind in telemetry.KINDS, f"unknown step kind {kind!r}: {row}"
    return kind


def _check_step(row: dict[str, str], agent: str, run_id: str) -> str:
    """The step's kind, after checking what every step of a run shows: name, ids as kwargs, a short result."""
    kind = _kind(row, agent)
    assert run_id in row.get("kwargs", ""), f"run id not in the kwargs: {row}"
    assert "seq" in row.get("kwargs", ""), f"seq not in the kwargs: {row}"
    assert len(row.get("result", "")) <= RESULT_MAX, f"result too long for a summary: {row}"
    return kind


def _table(title: str, rows: list[dict[str, str]]) -> str:
    columns = ("name", "state", "args", "kwargs", "result", "exception")
    cells = [[row.get(column, "") for column in columns] for row in rows]
    widths = [max([len(column), *(len(line[i]) for line in cells)]) for i, column in enumerate(columns)]
    lines = [title, "  ".join(column.ljust(widths[i]) for i, column in enumerate(columns))]
    lines += ["  ".join(value.ljust(widths[i]) for i, value in enumerate(line)) for line in cells]
    return "\n".join(lines)


def test_flower_finds_a_runs_steps_by_id_named_for_agent_and_kind_and_shows_failed_steps(
    flower_and_browser: tuple[Cluster, FlowerProcess, EventTap, Any],
) -> None:
    cluster, flower, tap, context = flower_and_browser
    began = time.monotonic()
    # Given Flower, a worker, and a beat sending both sweeps every second; Flower listens before any run
    # starts (it sees only the events sent while it listens).
    flower.start()
    worker = cluster.start_worker(concurrency=2, wait=False)
    cluster.start_beat()
    flower.wait_ready()
    cluster.wait_ready(worker)
    ready = time.monotonic()

    # When three runs go: one finishes, one parks, one is retried once and finishes.
    done, parked, retried = fresh_id(agents.SCOUT), fresh_id(agents.BREAKER), fresh_id(agents.FLAKY)
    for agent, run_id in ((agents.SCOUT, done), (agents.BREAKER, parked), (agents.FLAKY, retried)):
        cluster.send(agent, run_id, agents.prompt(run_id))
    cluster.wait_finished([done, retried], timeout=20)
    wait_until(lambda: _is_parked(cluster, parked), 20, f"run {parked} parked")
    settled = time.monotonic()

    # Then the tasks page, searched by each run's id, shows that run's steps.
    page = TasksPage(context.new_page(), flower)
    page.open()
    done_rows = _steps(page, done)
    assert done_rows, f"Flower shows no step of run {done}: are task events on?"
    parked_rows = _steps(page, parked)
    retried_rows = _steps(page, retried)
    page.search("lousho.recover")
    sweep_rows = page.rows()
    page.search("lousho.schedules")
    sweep_rows += page.rows()
    page.search("")
    shown = page.text()
    info = page.page.inner_text(".dataTables_info")
    looked = time.monotonic()
    beats_sent = sum(
        path.read_text(errors="replace").count("Sending due task") for path in cluster.workdir.glob("beat-*.log")
    )

    print("\n" + _table(f"[flower] run {done} ({agents.SCOUT}), as the tasks page shows it:", done_rows))
    print(_table(f"[flower] run {parked} ({agents.BREAKER}):", parked_rows))
    print(_table(f"[flower] run {retried} ({agents.FLAKY}):", retried_rows))
    print(f"[flower] unfiltered: {info!r}; sweep rows {len(sweep_rows)} while the beat sent {beats_sent} sweeps")
    print(
        f"[flower] raw task events of the three runs: {len(tap.task_events('sent', '-'))} task-sent,"
        f" {len(tap.task_events('received', '-'))} task-received"
    )
    print(
        f"[flower] timings: flower + worker + beat up {ready - began:.1f} s, runs settled {settled - ready:.1f} s,"
        f" page read {looked - settled:.1f} s"
    )

    # The finished run: every step succeeded, named for the agent, ids in kwargs, a short result.
    kinds = [_check_step(row, agents.SCOUT, done) for row in done_rows]
    assert {"model turn", "tool batch"} <= set(kinds), kinds
    assert {row["state"] for row in done_rows} == {"SUCCESS"}, done_rows
    assert all(row["result"] for row in done_rows), done_rows

    # The parked run: the tool batch that parked it shows FAILURE, with the error's code and nothing else.
    parked_kinds = [_check_step(row, agents.BREAKER, parked) for row in parked_rows]
    failed = [row for row, kind in zip(parked_rows, parked_kinds, strict=True) if kind == "tool batch"]
    assert failed and {row["state"] for row in failed} == {"FAILURE"}, parked_rows
    assert all("LOUSHO_TOOL_PROPAGATED" in row["exception"] for row in failed), failed

    # The retried run: the batch recorded for a retry shows RETRY, the run then finishes with successes.
    retried_states = [row["state"] for row in retried_rows]
    retried_kinds = [_check_step(row, agents.FLAKY, retried) for row in retried_rows]
    assert "RETRY" in retried_states and "FAILURE" not in retried_states, retried_rows
    assert retried_kinds[retried_states.index("RETRY")] == "tool batch", retried_rows
    assert retried_states[-1] == "SUCCESS", retried_rows

    # The sweeps do not flood the list: none shows, and the list holds only the three runs' steps.
    assert beats_sent >= 2
    assert sweep_rows == []
    assert f"of {len(done_rows) + len(parked_rows) + len(retried_rows)} tasks" in info, info
    # No prompt, tool argument, tool output or model output anywhere on the page.
    for rows in (done_rows, parked_rows, retried_rows):
        for row in rows:
            assert not [mark for mark in agents.MARKERS if mark in " ".join(row.values())], row
    assert not [mark for mark in agents.MARKERS if mark in shown]
    # Every step message's events carry the step's name, the sender's task-sent included (Flower applies
    # a task-sent that arrives after the worker's task-received over it), whatever order they arrive in.
    sent = tap.task_events("sent", done)
    assert sent, f"no task-sent event for run {done}: are the workers' sent events on?"
    for agent, run_id in ((agents.SCOUT, done), (agents.BREAKER, parked), (agents.FLAKY, retried)):
        for kind in ("sent", "received"):
            for event in tap.task_events(kind, run_id):
                _kind({"name": event.get("name", "")}, agent)
    assert not [e for e in tap.drain() if e.get("name") in ("lousho.recover", "lousho.schedules")]
    assert looked - began < 45
