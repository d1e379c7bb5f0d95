"""The why at the top of an unfinished run's page, in a real Chromium, checked against ``Client.describe``.

Every test runs a real ``celery worker`` on the agents of the page tests and reads the pages served by ``lousho
webhooks serve``: a run awaiting approval, a retrying run and a lead waiting on its child's approval each show
their state, what they wait on (with links to decide the approvals and to the children) and their next action as
``describe`` gives them; a run that finishes loses its why on the page left open.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from store.summaries import RunSummary
from tests.support import ui_agents
from tests.support import why_agents as why
from tests.support.cluster import Cluster, fresh_id, wait_until
from tests.support.ui_fixtures import UiServer, figure, sign_in

pytestmark = pytest.mark.crash

PHONE_WIDTH = 390
#: How soon a change of the run must show on a page left open (its live refresh), on a loaded machine.
LIVE_MS = 10_000


def _described(
    cluster: Cluster,
    run_id: str,
    state: str,
    what: Callable[[RunSummary], bool] = lambda _: True,
    timeout: float = 30.0,
) -> RunSummary:
    """``describe`` of ``run_id`` once it is in ``state`` and ``what`` holds of it."""
    found: list[RunSummary] = []

    def seen() -> bool:
        told = cluster.client.describe(run_id)
        if told is not None and told.state == state and told.waiting_on is not None and what(told):
            found.append(told)
            return True
        return False

    wait_until(seen, timeout, f"run {run_id} {state}", interval=0.2)
    return found[0]


def _ids(locator: Any, attribute: str) -> list[str]:
    return [str(locator.nth(i).get_attribute(attribute)) for i in range(locator.count())]


def _check_top(page: Any, told: RunSummary) -> Any:
    """The why is above the status line and says ``told``'s state and next action; the why's locator."""
    shown = page.locator("section#why")
    assert shown.count() == 1, "no why on the page of an unfinished run"
    assert page.evaluate("""() => Boolean(document.getElementById('why').compareDocumentPosition(
        document.getElementById('run-status')) & Node.DOCUMENT_POSITION_FOLLOWING)"""), "the why is not at the top"
    assert shown.get_attribute("data-state") == told.state
    assert shown.locator(".why-state .state").inner_text().strip() == told.state
    assert page.locator("#next-action").inner_text().strip() == told.next_action
    return shown


def test_a_run_awaiting_approval_says_so_and_links_to_each_approval_to_decide(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    run_id = fresh_id("pay")
    cluster.send(ui_agents.PAYER, run_id, ui_agents.pay_prompt(run_id))
    told = _described(
        cluster, run_id, "awaiting-approval", lambda t: t.waiting_on is not None and len(t.waiting_on.approval_ids) == 2
    )
    assert told.waiting_on is not None

    # Given its page
    page = sign_in(new_context, ui_server)
    page.goto(f"/ui/runs/{run_id}")

    # Then the why says it awaits approval, a person must act, and what moves it next, as describe does
    shown = _check_top(page, told)
    assert shown.locator(".person").count() == 1
    waits = shown.locator("li.approval-wait")
    assert _ids(waits, "data-approval-id") == told.waiting_on.approval_ids
    for approval_id in told.waiting_on.approval_ids:
        link = shown.locator(f"li.approval-wait[data-approval-id='{approval_id}'] a.decide-link")
        assert link.get_attribute("href") == f"#approval-{approval_id}"
        assert link.locator(".tool-name").inner_text().strip() == "pay"
    assert shown.locator("li.child-wait, li.retry, li.unserved").count() == 0

    # When they follow the second link, they are at that approval's card, with its form to decide it
    second = told.waiting_on.approval_ids[1]
    shown.locator(f"li.approval-wait[data-approval-id='{second}'] a.decide-link").click()
    page.wait_for_function("id => location.hash === '#approval-' + id", arg=second)
    assert page.evaluate("() => document.querySelector(':target').dataset.approvalId") == second
    target = page.locator(f"#approval-{second}")
    assert target.locator("form.decide button[name=decision][value=approve]").is_visible()
    figure("why of a run awaiting approval", started)


def test_a_retrying_run_shows_when_it_tries_again_at_a_phones_width(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    run_id = fresh_id("stall")
    cluster.send(why.STALLER, run_id, "stall")
    told = _described(
        cluster, run_id, "retrying", lambda t: t.waiting_on is not None and t.waiting_on.retry_at is not None
    )
    assert told.waiting_on is not None and told.waiting_on.retry_at is not None and told.last_error is not None

    # Given its page on a phone
    page = sign_in(new_context, ui_server, viewport={"width": PHONE_WIDTH, "height": 800})
    page.goto(f"/ui/runs/{run_id}")

    # Then the why says it is retrying after its failures, at the time describe gives, and what moves it next
    shown = _check_top(page, told)
    retry_at = shown.locator("li.retry time.retry-at")
    assert retry_at.get_attribute("datetime") == told.waiting_on.retry_at.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert int(str(shown.locator(".failures").get_attribute("data-failures"))) == told.failures >= 1
    assert shown.locator(".person").count() == 0
    assert told.last_error.code in page.locator("#last-error").inner_text()
    assert shown.locator("li.approval-wait, li.child-wait, li.unserved").count() == 0
    assert int(page.evaluate("document.documentElement.scrollWidth")) <= PHONE_WIDTH + 1, "wider than a phone"
    figure("why of a retrying run", started)


def test_a_lead_waiting_on_its_childs_approval_links_to_both_and_loses_its_why_once_finished(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    lead_id = fresh_id("oversee")
    cluster.send(why.FOREMAN, lead_id, "oversee the filing")
    told = _described(cluster, lead_id, "waiting", lambda t: bool(t.waiting_on and t.waiting_on.approval_ids))
    assert told.waiting_on is not None and len(told.waiting_on.children) == 1
    child_id = told.waiting_on.children[0]
    (approval_id,) = told.waiting_on.approval_ids
    assert {a.approval_id: a.session_id for a in cluster.client.approvals.list()}[approval_id] == child_id

    # Given the lead's page, and a second page of it left open
    context = sign_in(new_context, ui_server).context
    page = context.pages[0]
    page.goto(f"/ui/runs/{lead_id}")
    left_open = context.new_page()
    left_open.goto(f"/ui/runs/{lead_id}")
    left_open.evaluate("window.__notReloaded = true")

    # Then the why says it waits, on which child, and on which of the child's approvals, as describe does
    shown = _check_top(page, told)
    children = shown.locator("li.child-wait")
    assert _ids(children, "data-run-id") == told.waiting_on.children
    assert children.first.locator("a").get_attribute("href") == f"/ui/runs/{child_id}"
    assert children.first.locator(".state").inner_text().strip() == "awaiting-approval"
    wait = shown.locator("li.approval-wait")
    assert _ids(wait, "data-approval-id") == [approval_id]
    assert wait.locator("a.decide-link").get_attribute("href") == f"/ui/runs/{child_id}#approval-{approval_id}"
    assert wait.locator("a.of-run").get_attribute("href") == f"/ui/runs/{child_id}"
    assert wait.locator(".tool-name").inner_text().strip() == "file_form"

    # When they follow the link to decide, they are at the approval on the child's page, and approve it there
    wait.locator("a.decide-link").click()
    page.wait_for_url(f"**/ui/runs/{child_id}#approval-{approval_id}")
    card = page.locator(f"#approval-{approval_id}")
    with page.expect_navigation():
        card.locator("form.decide button[name=decision][value=approve]").click()

    # Then the lead finishes, and the page left open drops its why without a reload
    cluster.wait_finished([lead_id], timeout=40)
    left_open.locator("#run-status[data-status=finished]").wait_for(timeout=LIVE_MS)
    assert left_open.locator("section#why").count() == 0
    assert left_open.evaluate("window.__notReloaded === true"), "the page reloaded instead of updating itself"
    assert cluster.client.describe(lead_id).state == "finished"  # type: ignore[union-attr]  # the run exists
    figure("why of a waiting lead", started)
