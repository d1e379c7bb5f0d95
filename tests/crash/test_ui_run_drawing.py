"""A run's children, usage, step durations and drawn timeline, and the runs list's counts, in a real Chromium.

Every test runs a real ``celery worker`` on ``tests.support.drawn_agents`` (and the agents of the page tests) and reads
the pages served by ``lousho webhooks serve``. What a page shows is checked against what the store holds: the
children's parents, each ``task`` call's child, the run's usage, each bar's start and end against the stored
event, approval and child times, and the counts against the store's listing.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import psycopg
import pytest

from store.approvals import PostgresApprovalStore
from store.events import Event
from store.records import ListedRun, Usage
from tests.support import drawn_agents as drawn
from tests.support import ui_agents
from tests.support.cluster import Cluster, fresh_id, wait_until
from tests.support.ui_fixtures import UiServer, figure, sign_in

pytestmark = pytest.mark.crash

PHONE_WIDTH = 390
#: Bars are placed to the millisecond (their data-start and data-end carry milliseconds).
MS = timedelta(milliseconds=1)


def _when(text: str | None) -> datetime:
    assert text, "a bar without its time"
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _events(cluster: Cluster, run_id: str) -> list[Event]:
    return cluster.client.read_events(run_id, -1, 1000)


def _tree(cluster: Cluster, run_id: str) -> dict[str, str | None]:
    """Every stored run under ``run_id`` (children, their children...) -> its stored parent."""
    page = cluster.client.store.list_runs(id_contains=f"{run_id}.task-", limit=500)
    return {run.session_id: run.parent_id for run in page.items if run.session_id.startswith(f"{run_id}.task-")}


def _children_by_call(cluster: Cluster, run_id: str) -> dict[str, str]:
    return {
        str(e.data["tool_call_id"]): str(e.data["child_run_id"])
        for e in _events(cluster, run_id)
        if e.type == "subagent.start"
    }


def test_a_leads_page_shows_its_children_as_a_tree_with_a_link_from_each_task_result(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    lead_id = fresh_id("draft")
    cluster.send(drawn.DRAFTER, lead_id, "draft it")
    cluster.wait_finished([lead_id], timeout=40)
    stored = _tree(cluster, lead_id)
    by_call = _children_by_call(cluster, lead_id)
    deep, shallow = by_call["t-deep"], by_call["t-shallow"]
    grandchild = _children_by_call(cluster, deep)["t-dig"]
    assert stored == {deep: lead_id, shallow: lead_id, grandchild: deep}

    # Given the lead's page
    page = sign_in(new_context, ui_server)
    page.goto(f"/ui/runs/{lead_id}")

    # Then its children are a tree under it: each run nested in the node of its stored lead, with its state
    nodes = page.locator("section#children li.child")
    shown = {
        nodes.nth(i).get_attribute("data-run-id"): nodes.nth(i).evaluate(
            "el => { const up = el.parentElement.closest('li.child'); return up ? up.dataset.runId : null; }"
        )
        for i in range(nodes.count())
    }
    assert shown == {deep: None, shallow: None, grandchild: deep}, shown
    listed = {
        run.session_id: run.state
        for run in cluster.client.store.list_runs(id_contains=f"{lead_id}.task-", limit=500).items
    }
    for run_id in stored:
        node = page.locator(f"section#children li.child[data-run-id='{run_id}']")
        assert node.locator(":scope > .node .state").first.get_attribute("data-state") == listed[run_id]
        assert node.locator(":scope > .node a").first.get_attribute("href") == f"/ui/runs/{run_id}"

    # ... each task call's result links to the child that gave it
    for call_id, child in by_call.items():
        link = page.locator(f"ol#timeline .tool-call[data-call-id='{call_id}'] a.child-link")
        assert link.count() == 1, f"no link from {call_id}'s result"
        assert link.get_attribute("href") == f"/ui/runs/{child}"

    # ... and the run's usage is the stored one
    usage = cluster.checkpoint(drawn.DRAFTER, lead_id).usage
    shown_usage = page.locator("#run-usage")
    assert int(str(shown_usage.get_attribute("data-input-tokens"))) == usage.input_tokens
    assert int(str(shown_usage.get_attribute("data-output-tokens"))) == usage.output_tokens
    assert f"{usage.input_tokens:,}" in shown_usage.inner_text()
    assert page.locator("#run-cost").count() == 0, "a cost shown for a run whose worker recorded none"

    # When they follow the deep scout's link, they are on its page: its own child under it, its lead linked
    page.locator("ol#timeline .tool-call[data-call-id='t-deep'] a.child-link").click()
    page.wait_for_url(f"**/ui/runs/{deep}")
    assert page.locator("#lead-link a").get_attribute("href") == f"/ui/runs/{lead_id}"
    under = page.locator("section#children li.child")
    assert [under.nth(i).get_attribute("data-run-id") for i in range(under.count())] == [grandchild]
    page.locator("ol#timeline .tool-call[data-call-id='t-dig'] a.child-link").click()
    page.wait_for_url(f"**/ui/runs/{grandchild}")
    assert page.locator("section#children").count() == 0
    figure("tree and links", started)


def _three_runs(cluster: Cluster) -> tuple[str, str, str, list[ListedRun]]:
    """A finished run made two hours old, a finished run and a run waiting on a person; and the store's listing."""
    old_id, done_id, paused_id = fresh_id("chosen"), fresh_id("chosen"), fresh_id("pay")
    for run_id in (old_id, done_id):
        cluster.send(ui_agents.CHOOSER, run_id, "pick a shade")
    cluster.send(ui_agents.PAYER, paused_id, ui_agents.pay_prompt(paused_id))
    cluster.wait_finished([old_id, done_id])
    wait_until(lambda: cluster.statuses([paused_id])[paused_id]["status"] == "awaiting-approval", 20, "the pause")
    # The first run is made two hours old, as a run started earlier would be.
    with psycopg.connect(cluster.database_url) as conn:
        conn.execute("UPDATE runs SET created_at = created_at - interval '2 hours' WHERE session_id = %s", (old_id,))
    listed = cluster.client.store.list_runs(limit=500).items
    assert {run.session_id for run in listed} == {old_id, done_id, paused_id}
    return old_id, done_id, paused_id, listed


def _rows(page: Any) -> set[str]:
    found = page.locator("table#runs tbody tr.run")
    return {str(found.nth(i).get_attribute("data-run-id")) for i in range(found.count())}


def _counts(page: Any) -> dict[str, int]:
    links = page.locator("nav#state-counts a.state-count")
    return {
        str(links.nth(i).get_attribute("data-state")): int(str(links.nth(i).get_attribute("data-count")))
        for i in range(links.count())
    }


def test_the_runs_list_keeps_the_runs_created_in_a_time_window_or_since_a_time(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    old_id, done_id, paused_id, listed = _three_runs(cluster)
    created = {run.session_id: run.created_at for run in listed}

    # Given the runs list with every run
    page = sign_in(new_context, ui_server)
    assert _rows(page) == {old_id, done_id, paused_id}

    # When they keep the last hour only, the old run leaves the list
    page.locator("form#filters select[name=since]").select_option("1h")
    page.locator("form#filters button[type=submit]").click()
    page.wait_for_url(re.compile(r"since=1h"))
    assert _rows(page) == {done_id, paused_id}
    assert page.locator("form#filters select[name=since]").input_value() == "1h"

    # ... and from a time to the microsecond: the runs created at or after it, the others before it
    newest = max((done_id, paused_id), key=lambda run_id: created[run_id])
    page.goto("/ui/runs?" + urlencode({"since": created[newest].isoformat()}))
    assert _rows(page) == {newest}
    assert page.locator("form#filters select[name=since] option:checked").inner_text().startswith("since ")
    page.goto("/ui/runs?since=not-a-time")
    assert _rows(page) == {old_id, done_id, paused_id}
    figure("time filter", started)


def test_the_runs_list_counts_runs_by_state_as_the_store_lists_them(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    old_id, _, paused_id, listed = _three_runs(cluster)

    # Given the runs list: a count per state, as the store lists them
    page = sign_in(new_context, ui_server)
    assert _counts(page) == dict(Counter(run.state for run in listed)), _counts(page)
    assert int(str(page.locator("nav#state-counts").get_attribute("data-total"))) == 3

    # When they pick a state from its count, the list shows those runs only
    paused_state = next(run.state for run in listed if run.session_id == paused_id)
    with page.expect_navigation():
        page.locator(f"nav#state-counts a.state-count[data-state='{paused_state}']").click()
    assert _rows(page) == {paused_id}

    # When they keep the last hour, the counts follow
    page.goto("/ui/runs?since=1h")
    assert _counts(page) == dict(Counter(run.state for run in listed if run.session_id != old_id))
    assert int(str(page.locator("nav#state-counts").get_attribute("data-total"))) == 2
    figure("counts", started)


def _bars(page: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """Every bar of the drawing: (kind, key) -> its times and its place, measured in the browser."""
    found: list[dict[str, Any]] = page.evaluate("""() => {
        const svg = document.querySelector('figure#drawing svg');
        const axis = svg.querySelector('.axis-line').getBoundingClientRect();
        return [...svg.querySelectorAll('g.bar')].map(g => {
            const box = g.querySelector('rect').getBoundingClientRect();
            const label = g.querySelector('text');
            return {kind: g.dataset.kind, key: g.dataset.key, start: g.dataset.start, end: g.dataset.end,
                    left: (box.left - axis.left) / axis.width, right: (box.right - axis.left) / axis.width,
                    font: label ? parseFloat(getComputedStyle(label).fontSize) : 0,
                    open: g.classList.contains('open')};
        });
    }""")
    return {(bar["kind"], bar["key"]): bar for bar in found}


def test_the_drawing_puts_each_step_call_and_wait_on_one_axis_at_its_stored_times(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    run_id = fresh_id("survey")
    cluster.send(drawn.SURVEYOR, run_id, f"survey {run_id}")
    wait_until(lambda: cluster.statuses([run_id])[run_id]["status"] == "awaiting-approval", 30, "the stamp's pause")

    # Given the page of the run waiting on a person, at a phone's width
    page = sign_in(new_context, ui_server, viewport={"width": PHONE_WIDTH, "height": 844})
    page.goto(f"/ui/runs/{run_id}")
    waiting = _bars(page)
    approval = next(key for kind, key in waiting if kind == "approval")
    assert waiting[("approval", approval)]["open"], "the approval still waited on is not drawn as open"

    # When they approve the stamp, and the run goes on to its child and its end
    stamp = page.locator(f"section#approvals .approval[data-approval-id='{approval}']")
    with page.expect_navigation():
        stamp.locator("form.decide button[name=decision][value=approve]").click()
    cluster.wait_finished([run_id], timeout=40)
    page.goto(f"/ui/runs/{run_id}")

    # Then every step, call and wait is a bar with the stored times, placed on one axis
    events = _events(cluster, run_id)
    decided = PostgresApprovalStore(cluster.client.engine).by_ids([approval])[approval]
    assert decided.created_at is not None and decided.decided_at is not None
    expected: dict[tuple[str, str], tuple[datetime, datetime]] = {}
    for event in events:
        duration = event.data.get("duration_ms")
        if event.type == "step.done":
            assert isinstance(duration, (int, float)), f"step.done without its duration: {event.data}"
            expected[("step", str(event.seq))] = (event.at - timedelta(milliseconds=duration), event.at)
        elif event.type in ("tool.done", "tool.error") and isinstance(duration, (int, float)):
            expected[("tool", str(event.data["tool_call_id"]))] = (
                event.at - timedelta(milliseconds=duration),
                event.at,
            )
    starts = sorted(start for start, _ in expected.values())
    retry = next(e for e in events if e.type == "provider.retry")
    expected[("retry", str(retry.seq))] = (retry.at, min(s for s in starts if s >= retry.at))
    expected[("approval", approval)] = (decided.created_at, decided.decided_at)
    delegated = next(e for e in events if e.type == "subagent.start")
    settled = next(e for e in events if e.type == "subagent.done")
    expected[("children", str(delegated.data["child_run_id"]))] = (delegated.at, settled.at)

    bars = _bars(page)
    assert set(bars) == set(expected), f"drawn {sorted(bars)}, stored {sorted(expected)}"
    assert not any(bar["open"] for bar in bars.values())
    svg = page.locator("figure#drawing svg")
    origin, axis_end = _when(svg.get_attribute("data-origin")), _when(svg.get_attribute("data-end"))
    assert abs(origin - min(start for start, _ in expected.values())) <= MS
    assert abs(axis_end - max(end for _, end in expected.values())) <= MS
    span = (axis_end - origin).total_seconds()
    for key, (start, end) in expected.items():
        bar = bars[key]
        assert abs(_when(bar["start"]) - start) <= MS and abs(_when(bar["end"]) - end) <= MS, (key, bar, start, end)
        # The bar's left edge stands at its start on the axis; its right edge at its end (or further, when too
        # short to see: at least a minimum width).
        assert abs(bar["left"] - (start - origin).total_seconds() / span) < 0.01, (key, bar)
        assert bar["right"] >= (end - origin).total_seconds() / span - 0.01, (key, bar)
        assert bar["font"] >= 11, f"the label of {key} is too small to read: {bar['font']} px"
    slow = bars[("tool", "m-survey")]
    assert slow["right"] - slow["left"] >= 0.95 * drawn.SURVEY_MS / 1000 / span

    # ... each step's duration is the one stored, and the page fits the phone
    recorded = [float(e.data["duration_ms"]) for e in events if e.type == "step.done"]
    shown = page.locator("ol#timeline li.step .step-duration")
    assert [float(str(shown.nth(i).get_attribute("data-ms"))) for i in range(shown.count())] == recorded
    assert int(page.evaluate("document.documentElement.scrollWidth")) <= PHONE_WIDTH + 1

    # ... and the run's cost is what its worker recorded for each turn, at the agent's prices
    costs = [e.data.get("cost") for e in events if e.type == "step.done"]
    turn = Usage(**drawn.TURN_USAGE)
    assert costs == [pytest.approx(drawn.SURVEY_PRICES.cost(turn))] * len(recorded), costs
    cost = page.locator("#run-cost")
    assert float(str(cost.get_attribute("data-cost"))) == pytest.approx(sum(float(c or 0) for c in costs))
    print(f"figure: {len(bars)} bars over {span:.2f} s")
    figure("drawing", started)
