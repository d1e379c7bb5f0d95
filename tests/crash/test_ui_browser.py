"""The run pages in a real headless Chromium: sign in, decide paused runs, answer, abort, resume, fork, compare.

Every test runs a real ``celery worker`` on ``tests.support.ui_agents`` and drives the pages served by
``lousho webhooks serve`` the way a person would: typing, clicking, pressing keys. What the pages claim is
checked against the stored runs. A request without the session cookie or without the CSRF token must be refused,
the pages must fit a phone's width and work from the keyboard, and times must show in the viewer's time zone.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any
from urllib.parse import parse_qs, urlparse
from zoneinfo import ZoneInfo

import pytest

from producer.trajectories import compare_trajectories
from tests.support import ui_agents as agents
from tests.support.cluster import Cluster, fresh_id, wait_until
from tests.support.ui_fixtures import UiServer

pytestmark = pytest.mark.crash

#: The widest the page body may be at a phone's width (390 CSS px, one px of rounding).
PHONE_WIDTH = 390
#: How soon a finished run must show on a page left open (the contract's 5 s, plus a loaded machine's second).
LIVE_S = 6.0


def _figure(name: str, started: float) -> None:
    print(f"figure: {name} {time.monotonic() - started:.1f} s")


def _sign_in(new_context: Callable[..., Any], server: UiServer, who: str = "ops", **options: Any) -> Any:
    """A page signed in with the key named ``who`` by the login form, on the runs list."""
    page = new_context(**options).new_page()
    _open_login(page)
    page.locator("form#login input[name=key]").fill(server.keys[who])
    page.locator("form#login button[type=submit]").click()
    page.wait_for_url(re.compile(r"/ui/runs(\?.*)?$"))
    assert who in page.locator("#who").inner_text()
    return page


def _open_login(page: Any) -> None:
    response = page.goto("/ui/login")
    assert response is not None and response.status == 200, f"GET /ui/login: {response and response.status}"
    assert "default-src 'self'" in response.headers.get("content-security-policy", "")


def _status(page: Any) -> str:
    return str(page.locator("#run-status").get_attribute("data-status"))


def _wait_status(cluster: Cluster, run_id: str, status: str, timeout: float = 20.0) -> None:
    wait_until(
        lambda: cluster.statuses([run_id]).get(run_id, {}).get("status") == status, timeout, f"run {run_id} {status}"
    )


def _mark_page(page: Any) -> None:
    """Tag the loaded document, so a later check can tell that the page was not reloaded meanwhile."""
    page.evaluate("window.__notReloaded = true")


def _wait_live(page: Any, status: str) -> None:
    """The page shows ``status`` without a reload."""
    page.locator(f"#run-status[data-status={status}]").wait_for(timeout=LIVE_S * 1000)
    assert page.evaluate("window.__notReloaded === true"), "the page reloaded instead of updating itself"


def _is_error(call: Any) -> bool:
    return bool(call.evaluate("el => el.classList.contains('error') || el.querySelector('.error') !== null"))


def _body_width(page: Any) -> int:
    return int(page.evaluate("document.documentElement.scrollWidth"))


def test_a_person_finds_a_paused_run_approves_one_call_rejects_the_other_and_sees_it_finish(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    done_id, paused_id = fresh_id("chosen"), fresh_id("pay")
    cluster.send(agents.CHOOSER, done_id, "pick a shade")
    cluster.send(agents.PAYER, paused_id, agents.pay_prompt(paused_id))
    cluster.wait_finished([done_id])
    _wait_status(cluster, paused_id, "awaiting-approval")

    # Given a signed-in person on the runs list, filtering by status and searching by id
    page = _sign_in(new_context, ui_server)
    assert page.locator("a#nav-runs").get_attribute("href") == "/ui/runs"
    assert page.locator("a#nav-approvals").get_attribute("href") == "/ui/approvals"
    assert page.locator(f"table#runs tr.run[data-run-id='{done_id}']").count() == 1
    page.locator("form#filters select[name=status]").select_option("awaiting-approval")
    page.locator("form#filters button[type=submit]").click()
    page.wait_for_url(re.compile(r"status=awaiting-approval"))
    rows = page.locator("table#runs tbody tr.run")
    assert [rows.nth(i).get_attribute("data-run-id") for i in range(rows.count())] == [paused_id]
    row = rows.first
    assert row.locator("td.status").inner_text().strip() == "awaiting-approval"
    assert row.locator("td.agent").inner_text().strip() == agents.PAYER
    page.goto(f"/ui/runs?q={paused_id[4:]}")
    assert page.locator("table#runs tbody tr.run").count() == 1
    page.goto(f"/ui/runs?q=no-such-run-{paused_id}")
    assert page.locator("p.empty").count() == 1

    # When they open it, they see its input, its step and its two gated calls
    page.goto("/ui/runs?status=awaiting-approval")
    page.locator(f"tr.run[data-run-id='{paused_id}'] td.id a").click()
    page.wait_for_url(f"**/ui/runs/{paused_id}")
    assert paused_id in page.locator("h1").inner_text()
    assert _status(page) == "awaiting-approval"
    assert page.locator("#run-agent").inner_text().strip() == agents.PAYER
    assert agents.pay_prompt(paused_id) in page.locator("ol#timeline li.input .input-text").first.inner_text()
    step = page.locator("ol#timeline li.step[data-step='1']")
    assert "two payments to make" in step.locator(".model-text").inner_text()
    calls = step.locator(".tool-call")
    assert calls.count() == 2
    assert [calls.nth(i).locator(".tool-name").inner_text().strip() for i in range(2)] == ["pay", "pay"]
    assert "alice" in calls.nth(0).locator(".tool-args").inner_text()
    assert page.locator("section#approvals .approval").count() == 2
    inline = page.evaluate("""() => [...document.scripts].filter(
        s => !s.src && s.type !== 'application/json').map(s => s.outerHTML.slice(0, 80))""")
    assert inline == [], f"inline scripts on the run page: {inline}"

    # ... and they approve alice's payment and reject bob's with a note, from the page
    alice = page.locator("section#approvals .approval").filter(has_text="alice")
    assert alice.locator(".tool-name").inner_text().strip() == "pay"
    with page.expect_navigation():
        alice.locator("form.decide button[name=decision][value=approve]").click()
    page.wait_for_url(f"**/ui/runs/{paused_id}")
    note = "Not bob, not this month"
    bob = page.locator("section#approvals .approval").filter(has_text="bob")
    bob.locator("form.decide textarea[name=note]").fill(note)
    with page.expect_navigation():
        bob.locator("form.decide button[name=decision][value=reject]").click()
    page.wait_for_url(f"**/ui/runs/{paused_id}")

    # Then the run goes on (its last turn waits for the test) and the open page shows it finished without a reload
    assert _status(page) in ("running", "awaiting-approval")
    _mark_page(page)
    decided = time.monotonic()
    agents.release_marker(cluster.log_path, paused_id).touch()
    _wait_live(page, "finished")
    _figure("last turn released to finished shown live", decided)
    page.locator("ol#timeline li.step[data-step='2']").wait_for(timeout=LIVE_S * 1000)
    page.reload()
    assert "stop" in page.locator("#finish-reason").inner_text()
    last = page.locator("ol#timeline li.step[data-step='2'] .model-text").inner_text()
    assert last.startswith("paid: sent 10 to alice")
    assert page.locator("section#approvals form.decide").count() == 0
    paid = page.locator("ol#timeline .tool-call[data-call-id='call_0_0']")
    refused = page.locator("ol#timeline .tool-call[data-call-id='call_0_1']")
    assert "sent 10 to alice" in paid.locator(".tool-result").inner_text()
    assert not _is_error(paid)
    assert note in refused.inner_text() and _is_error(refused)
    messages = cluster.checkpoint(agents.PAYER, paused_id).messages
    assert str(messages[-1].content).startswith("paid: sent 10 to alice")
    assert note in str(messages[-1].content)
    _figure("find, open, approve, reject, finish", started)


def test_a_person_answers_a_question_from_the_inbox_and_the_run_uses_the_answer(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    run_id = fresh_id("book")
    cluster.send(agents.BOOKER, run_id, "book me a trip")
    _wait_status(cluster, run_id, "awaiting-approval")

    # Given the question in the approvals inbox
    page = _sign_in(new_context, ui_server)
    page.locator("a#nav-approvals").click()
    page.wait_for_url("**/ui/approvals")
    item = page.locator(".approval[data-approval-id]").filter(has=page.locator(f"a.run[href$='/ui/runs/{run_id}']"))
    assert item.count() == 1
    assert item.locator(".agent").inner_text().strip() == agents.BOOKER
    assert item.locator(".tool-name").inner_text().strip() == "ask_question"
    assert item.locator("time[datetime]").count() == 1

    # When they open its run and answer it there
    item.locator("a.run").click()
    page.wait_for_url(f"**/ui/runs/{run_id}")
    question = page.locator("section#approvals .approval")
    assert agents.QUESTION in question.locator(".question").inner_text()
    question.locator("input[name=answer]").fill("Oslo")
    with page.expect_navigation():
        question.locator("button[name=decision][value=answer]").click()
    page.wait_for_url(f"**/ui/runs/{run_id}")
    _mark_page(page)

    # Then the run finishes with the answer, and the page shows it
    _wait_live(page, "finished")
    page.locator("ol#timeline li.step[data-step='2']").wait_for(timeout=LIVE_S * 1000)
    assert "booked Oslo" in page.locator("ol#timeline li.step[data-step='2'] .model-text").inner_text()
    assert cluster.checkpoint(agents.BOOKER, run_id).messages[-1].content == "booked Oslo"
    page.goto("/ui/approvals")
    assert page.locator(f".approval a.run[href$='/ui/runs/{run_id}']").count() == 0
    _figure("answer a question", started)


def test_a_person_aborts_a_running_run_and_resumes_it(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    run_id = fresh_id("plod")
    cluster.send(agents.PLODDER, run_id, "walk a long way")
    cluster.wait_event(lambda e: e.get("run_id") == run_id and e.get("phase") == "start", what="the long call")

    # Given the page of a run whose long call is running
    page = _sign_in(new_context, ui_server)
    page.goto(f"/ui/runs/{run_id}")
    assert _status(page) == "running"
    assert page.locator("form#resume").count() == 0

    # When they abort it
    with page.expect_navigation():
        page.locator("form#abort button[type=submit]").click()
    page.wait_for_url(f"**/ui/runs/{run_id}")
    clicked = time.monotonic()
    _mark_page(page)

    # Then the running call stops early and the page shows the run aborted
    _wait_live(page, "aborted")
    _figure("abort to aborted shown", clicked)
    ended = cluster.wait_event(lambda e: e.get("run_id") == run_id and e.get("phase") == "end", what="the call's end")
    assert ended["cancelled"] is True
    assert cluster.checkpoint(agents.PLODDER, run_id).finish_reason == "aborted"

    # When they resume it from the page
    page.reload()
    assert page.locator("form#abort").count() == 0
    with page.expect_navigation():
        page.locator("form#resume button[type=submit]").click()
    page.wait_for_url(f"**/ui/runs/{run_id}")
    _mark_page(page)

    # Then it runs its remaining turns and finishes
    _wait_live(page, "finished")
    checkpoint = cluster.checkpoint(agents.PLODDER, run_id)
    assert checkpoint.finish_reason == "stop"
    assert checkpoint.messages[-1].content == f"plodded: walked {agents.TRUDGE_SECOND_MS} ms"
    page.reload()
    assert page.locator("form#resume").count() == 0
    assert page.locator("ol#timeline li.step[data-step='3']").count() == 1
    _figure("abort and resume", started)


def test_a_person_forks_a_run_from_a_step_and_sees_where_the_two_diverge(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    run_id = fresh_id("choose")
    cluster.send(agents.CHOOSER, run_id, "pick a shade")
    cluster.wait_finished([run_id])
    fork_id = f"{run_id}-teal"

    # Given a finished run's page
    page = _sign_in(new_context, ui_server)
    page.goto(f"/ui/runs/{run_id}")
    assert _status(page) == "finished"
    assert page.locator("ol#timeline li.step").count() == 3
    steps = page.locator("form#fork select[name=step] option")
    offered = {steps.nth(i).get_attribute("value") for i in range(steps.count())}
    assert {"1", "2", "3"} <= offered

    # When they fork it from step 2 with the second call's result patched
    form = page.locator("form#fork")
    form.locator("select[name=step]").select_option("2")
    form.locator("textarea[name=patch]").fill(
        json.dumps({"tool_result": {"tool_call_id": agents.SHADE_CALL_ID, "result": "teal"}})
    )
    form.locator("input[name=new_id]").fill(fork_id)
    form.locator("button[type=submit]").click()

    # Then they land on the comparison of the two runs, and the fork runs to its own end
    page.wait_for_url(re.compile(r"/ui/compare\?"))
    query = parse_qs(urlparse(page.url).query)
    assert query == {"a": [run_id], "b": [fork_id]}
    cluster.wait_finished([fork_id], timeout=20)
    assert cluster.checkpoint(agents.CHOOSER, fork_id).messages[-1].content == "chose teal"
    page.reload()
    expected = compare_trajectories(
        cluster.checkpoint(agents.CHOOSER, run_id), cluster.checkpoint(agents.CHOOSER, fork_id)
    ).diverged_at
    assert expected == 2  # same colour, then another shade: the step the fork started from
    text = page.locator("#divergence").inner_text()
    found = re.search(r"diverge at step (\d+)", text)
    assert found, f"#divergence says {text!r}"
    print(f"figure: #divergence reads {text.strip()!r} (compare_trajectories: step {expected})")
    assert int(found.group(1)) == expected
    for side, shade in (("#side-a", "navy"), ("#side-b", "teal")):
        column = page.locator(f"#compare {side}")
        assert column.locator(".step[data-index]").count() == 3
        assert column.locator(".step.diverged").count() >= 1, f"no step of {side} is marked .diverged"
        assert column.locator(".step.diverged").first.get_attribute("data-index") == str(expected)
        assert column.locator(".step[data-index='1'].diverged").count() == 0
        assert shade in column.locator(f".step[data-index='{expected}']").inner_text()
    _figure("fork and compare", started)


def test_a_request_without_the_session_cookie_or_the_csrf_token_is_refused(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    run_id = fresh_id("pay")
    cluster.send(agents.PAYER, run_id, agents.pay_prompt(run_id))
    _wait_status(cluster, run_id, "awaiting-approval")
    abort_url = f"/ui/runs/{run_id}/abort"

    # A wrong key is refused at the door; a page without a session sends the person there
    door = new_context().new_page()
    door.goto("/ui/login")
    door.locator("form#login input[name=key]").fill("x" * 32)
    door.locator("form#login button[type=submit]").click()
    assert "That key is not valid" in door.locator(".error").inner_text()
    stranger = new_context()
    sent_away = stranger.request.get(f"/ui/runs/{run_id}", max_redirects=0)
    assert sent_away.status == 303
    location = urlparse(sent_away.headers["location"])
    assert location.path == "/ui/login" and parse_qs(location.query)["next"] == [f"/ui/runs/{run_id}"]

    # Signing in from there leads back to the run, with a session cookie that holds no key
    page = new_context().new_page()
    page.goto(f"/ui/runs/{run_id}")
    page.wait_for_url(re.compile(r"/ui/login\?next="))
    page.locator("form#login input[name=key]").fill(ui_server.keys["ops"])
    page.locator("form#login button[type=submit]").click()
    page.wait_for_url(f"**/ui/runs/{run_id}")
    cookie = next(c for c in page.context.cookies() if c["name"] == "lousho_session")
    assert (cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == (True, "Strict", "/ui")
    assert ui_server.keys["ops"] not in cookie["value"]
    token = page.locator("form#abort input[name=csrf_token]").input_value()
    assert token

    # Without the cookie: 401, even with a good token
    assert stranger.request.post(abort_url, form={"csrf_token": token}, max_redirects=0).status == 401
    # With the cookie, without the token, with a wrong one, or from another origin: 403
    missing = page.request.post(abort_url, form={"next": f"/ui/runs/{run_id}"}, max_redirects=0)
    assert missing.status == 403
    assert "CSRF token missing or invalid" in missing.text()
    assert page.request.post(abort_url, form={"csrf_token": token[::-1]}, max_redirects=0).status == 403
    assert (
        page.request.post(
            abort_url, form={"csrf_token": token}, headers={"origin": "http://evil.example"}, max_redirects=0
        ).status
        == 403
    )
    assert cluster.statuses([run_id])[run_id]["status"] == "awaiting-approval"

    # A read-only key sees no action and may not act, token or not
    viewer = _sign_in(new_context, ui_server, "viewer")
    viewer.goto(f"/ui/runs/{run_id}")
    assert _status(viewer) == "awaiting-approval"
    for form in ("form.decide", "form#abort", "form#resume", "form#fork"):
        assert viewer.locator(form).count() == 0, f"a read-only key sees {form}"
    viewer_token = viewer.locator("form#logout input[name=csrf_token]").input_value()
    assert viewer.request.post(abort_url, form={"csrf_token": viewer_token}, max_redirects=0).status == 403

    # With both, the same request goes through: the refusals were for what was missing
    allowed = page.request.post(abort_url, form={"csrf_token": token}, max_redirects=0)
    assert allowed.status == 303
    wait_until(lambda: cluster.checkpoint(agents.PAYER, run_id).finish_reason == "aborted", 15, "the run aborted")
    _figure("refusals", started)


def test_the_pages_fit_a_phone_and_work_from_the_keyboard(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    run_id = fresh_id("choose")
    cluster.send(agents.CHOOSER, run_id, "pick a shade")
    cluster.wait_finished([run_id])
    page = new_context(viewport={"width": PHONE_WIDTH, "height": 844}).new_page()

    # Signing in with the keyboard only: Tab to the key, type it, Tab to the button, Enter
    _open_login(page)
    for _ in range(15):
        if page.evaluate("document.activeElement && document.activeElement.name === 'key'"):
            break
        page.keyboard.press("Tab")
    page.keyboard.type(ui_server.keys["ops"])
    page.keyboard.press("Tab")
    focused = page.evaluate("""() => { const el = document.activeElement, style = getComputedStyle(el);
        return {button: el.matches('form#login button[type=submit]'), outline: style.outlineStyle,
                width: parseFloat(style.outlineWidth), shadow: style.boxShadow}; }""")
    assert focused["button"], "Tab from the key field does not reach the sign-in button"
    assert (focused["outline"] != "none" and focused["width"] > 0) or focused["shadow"] != "none", (
        f"the focused button shows no focus ring: {focused}"
    )
    page.keyboard.press("Enter")
    page.wait_for_url(re.compile(r"/ui/runs(\?.*)?$"))

    # Opening a run with the keyboard: Tab to its link, Enter
    link = f"tr.run[data-run-id='{run_id}'] td.id a"
    for _ in range(40):
        if page.evaluate("link => document.activeElement !== null && document.activeElement.matches(link)", link):
            break
        page.keyboard.press("Tab")
    page.keyboard.press("Enter")
    page.wait_for_url(f"**/ui/runs/{run_id}")

    # No page is wider than the phone
    widths = {}
    for path in ("/ui/runs", f"/ui/runs/{run_id}", "/ui/approvals", f"/ui/compare?a={run_id}&b={run_id}", "/ui/login"):
        page.goto(path)
        widths[path] = _body_width(page)
    print(f"figure: page widths at {PHONE_WIDTH} px: {widths}")
    assert all(width <= PHONE_WIDTH + 1 for width in widths.values()), widths
    _figure("phone width and keyboard", started)


def test_times_show_in_the_viewers_time_zone(
    cluster: Cluster, ui_server: UiServer, new_context: Callable[..., Any]
) -> None:
    started = time.monotonic()
    run_id = fresh_id("choose")
    cluster.send(agents.CHOOSER, run_id, "pick a shade")
    cluster.wait_finished([run_id])

    page = _sign_in(new_context, ui_server, timezone_id="Asia/Tokyo", locale="en-GB")
    stamp = page.locator(f"tr.run[data-run-id='{run_id}'] td.updated time[datetime]")
    raw = str(stamp.get_attribute("datetime"))
    assert raw.endswith("Z"), f"datetime={raw!r} is not UTC"
    utc = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    tokyo = utc.astimezone(ZoneInfo("Asia/Tokyo"))
    wait_until(lambda: stamp.inner_text().strip() not in ("", raw), 5, "the time rewritten by the page's script")
    shown = stamp.inner_text().strip()
    print(f"figure: {raw} shown in Tokyo as {shown!r}")
    # The first h:mm of the text is the time of day, in 24 or 12 hours.
    clock = re.search(r"(\d{1,2}):(\d{2})", shown)
    assert clock, f"{shown!r} shows no time of day"
    hour, minute = int(clock.group(1)), int(clock.group(2))
    assert hour in (tokyo.hour, tokyo.hour % 12 or 12) and minute == tokyo.minute, (
        f"{shown!r} is not Tokyo's {tokyo:%H:%M} (UTC {utc:%H:%M})"
    )
    _figure("time zone", started)
