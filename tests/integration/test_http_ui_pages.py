"""The run pages under /ui on the HTTP server: sign-in, sessions and CSRF, scopes, the pages, their actions, live."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient
from markupsafe import escape
from pydantic import SecretStr
from sqlalchemy import event

from producer.client import Client
from producer.http import Backend, WebhookConfig
from producer.server import create_app
from store import errors, keys
from store.approvals import PostgresApprovalStore
from store.checkpoints import PostgresCheckpointStore
from store.database import make_engine
from store.deliveries import PostgresDeliveryStore
from store.leases import Heartbeat, LeaseManager
from store.records import Message
from store.settings import Settings
from store.summaries import RunSummary
from tests.fakes.crash import die_at
from tests.support.http_fixtures import DESK, HOOKS, SECRET, Driver, key, truncate_producer_tables
from worker import Agent, tool
from worker.providers import MockModel
from worker.steps import StepDeps

pytestmark = pytest.mark.integration

FULL = "full-access-key-0123456789abcdef"
READER = "reader-key-0123456789abcdef"
DESK_ONLY = "desk-only-key-0123456789abcdef"
KEYS = f"ops={FULL},reader={READER};read,deskop={DESK_ONLY};agents=desk"
_TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')


@tool
def shade(n: int) -> str:
    """Pick a shade."""
    return "navy"


def _choose(messages: list[Message]) -> Any:
    turn = sum(1 for m in messages if m.role == "assistant")
    if turn < 2:
        return {"tool_calls": [{"name": "shade", "args": {"n": turn + 1}}]}
    return f"chose {messages[-1].content}"


def _book(messages: list[Message]) -> Any:
    if not any(m.role == "assistant" for m in messages):
        return {"tool_calls": [{"name": "ask_question", "args": {"question": "Which city?"}}]}
    return f"booked {messages[-1].content}"


CHOOSER = Agent(name="chooser", model=MockModel(_choose), instructions="Choose.", tools=[shade])
ASKER = Agent(name="asker", model=MockModel(_book), instructions="Book.", ask_question=True)
SCRIPTY = Agent(name="scripty", model=MockModel(["<script>alert(1)</script> done"]), instructions="Say it.")
BROKEN = Agent(name="broken", model=MockModel([{"error": "boom", "retryable": False}]), instructions="Fail.")


@tool(once=True)
def charge(order: str) -> str:
    """Charge the card for an order."""
    return f"charged {order}"


TILL = Agent(
    name="till",
    model=MockModel([{"tool_calls": [{"name": "charge", "args": {"order": "7"}}]}, "Charged."]),
    instructions="Charge.",
    tools=[charge],
)
AGENTS = {a.name: a for a in (HOOKS, DESK, CHOOSER, ASKER, SCRIPTY, BROKEN, TILL)}


def _not_yet(
    session_id: str, seq: int | None, countdown: float = 0.0, agent: str | None = None, /, *, name: str | None = None
) -> None:
    """The driver's place before it exists (replaced by ``Driver.enqueue`` at once)."""


@dataclass
class Site:
    """The server with the run pages, the driver that runs what it enqueues, and a client to start runs."""

    http: TestClient
    driver: Driver
    client: Client
    store: PostgresCheckpointStore

    def start(self, agent: str, run_id: str, text: str = "go", drain: bool = True) -> None:
        self.client.agent(agent).send(text, run_id)
        if drain:
            self.driver.drain()


def _build(
    settings: Settings,
    store: PostgresCheckpointStore,
    leases: LeaseManager,
    monkeypatch: pytest.MonkeyPatch,
    config: WebhookConfig,
    **ui: Any,
) -> Iterator[Site]:
    truncate_producer_tables()
    heartbeat = Heartbeat(leases, settings.lease_renew_ms)
    driver = Driver(StepDeps(store=store, leases=leases, heartbeat=heartbeat, agents=AGENTS, enqueue=_not_yet))
    driver.deps.enqueue = driver.enqueue
    store.register_agents({a.name: a.fingerprint() for a in AGENTS.values()})
    engine = make_engine(settings, pool_size=8)
    client = Client(settings, engine=engine)
    monkeypatch.setattr(
        client, "nudge", lambda session_id, agent=None, kind="": driver.enqueue(session_id, agent=agent)
    )
    backend = Backend(
        deliveries=PostgresDeliveryStore(engine),
        checkpoints=client.store,
        approvals=PostgresApprovalStore(engine),
        enqueue=driver.enqueue,
        lease_holder=leases.holder,
        known_agents=client.known_agents,
        client=client,
    )
    app = create_app(config, backend, settings=settings.model_copy(update=ui))
    with TestClient(app) as http:
        yield Site(http, driver, client, store)
    heartbeat.stop()
    client.close()
    engine.dispose()


@pytest.fixture
def site(
    settings: Settings, store: PostgresCheckpointStore, leases: LeaseManager, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Site]:
    config = WebhookConfig(secrets=(key(SECRET),), api_keys=SecretStr(KEYS))
    yield from _build(settings, store, leases, monkeypatch, config, flower_url="http://flower.test:5555")


def _token(html: str) -> str:
    found = _TOKEN.search(html)
    assert found, "no csrf_token in the page"
    return found.group(1)


def _sign_in(site: Site, secret: str = FULL) -> str:
    """Sign in; the CSRF token of the session's forms."""
    form = site.http.get("/ui/login")
    answer = site.http.post("/ui/login", data={"key": secret, "csrf_token": _token(form.text)}, follow_redirects=False)
    assert answer.status_code == 303, answer.text
    return _token(site.http.get("/ui/runs").text)


def _post(site: Site, path: str, token: str | None, **fields: str) -> Any:
    data = dict(fields, **({"csrf_token": token} if token is not None else {}))
    return site.http.post(path, data=data, follow_redirects=False)


def test_the_pages_are_absent_without_a_key_or_when_turned_off(
    settings: Settings, store: PostgresCheckpointStore, leases: LeaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_keys = WebhookConfig(secrets=(key(SECRET),))
    for site in _build(settings, store, leases, monkeypatch, no_keys):
        for path in ("/ui/login", "/ui/runs", "/ui/static/ui.js", "/ui/approvals"):
            assert site.http.get(path, follow_redirects=False).status_code == 404, path
        assert site.http.post("/ui/login", data={"key": "x"}).status_code == 404
    with_keys = WebhookConfig(secrets=(key(SECRET),), api_keys=SecretStr(KEYS))
    for site in _build(settings, store, leases, monkeypatch, with_keys, ui_enabled=False):
        assert site.http.get("/ui/login").status_code == 404
    for site in _build(settings, store, leases, monkeypatch, with_keys):
        assert site.http.get("/ui/login").status_code == 200


def test_sign_in_with_a_good_key_sets_a_strict_http_only_session_and_a_bad_key_is_refused(site: Site) -> None:
    page = site.http.get("/ui/runs", follow_redirects=False)
    assert page.status_code == 303 and page.headers["location"] == "/ui/login?next=%2Fui%2Fruns"
    form = site.http.get("/ui/login?next=/ui/approvals")
    assert 'id="login"' in form.text and 'type="password"' in form.text
    assert "default-src 'self'" in form.headers["content-security-policy"]
    bad = site.http.post("/ui/login", data={"key": "wrong-key-0123456789abcdef", "csrf_token": _token(form.text)})
    assert bad.status_code == 401 and "That key is not valid" in bad.text
    assert "lousho_session" not in site.http.cookies
    form = site.http.get("/ui/login")
    good = site.http.post(
        "/ui/login",
        data={"key": FULL, "csrf_token": _token(form.text), "next": "/ui/approvals"},
        follow_redirects=False,
    )
    assert good.status_code == 303 and good.headers["location"] == "/ui/approvals"
    cookie = next(c for c in good.headers.get_list("set-cookie") if c.startswith("lousho_session="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    assert "Max-Age=43200" in cookie  # LOUSHO_UI_SESSION_HOURS (12) in the browser too
    assert FULL not in cookie
    login_cookie = next(c for c in form.headers.get_list("set-cookie") if c.startswith("lousho_login="))
    assert "Max-Age=1800" in login_cookie and "HttpOnly" in login_cookie
    runs = site.http.get("/ui/runs")
    assert '<span id="who">ops</span>' in runs.text and 'id="logout"' in runs.text
    # A next path outside the pages is ignored; a forged cookie signs nobody in
    site.http.cookies.clear()
    form = site.http.get("/ui/login")
    away = site.http.post(
        "/ui/login",
        data={"key": FULL, "csrf_token": _token(form.text), "next": "https://evil.example/"},
        follow_redirects=False,
    )
    assert away.headers["location"] == "/ui/runs"
    site.http.cookies.clear()
    site.http.cookies.set("lousho_session", "e30.forged", path="/ui")
    assert site.http.get("/ui/runs", follow_redirects=False).status_code == 303


def test_posts_need_a_session_the_csrf_token_and_this_origin(site: Site) -> None:
    site.start("hooks", "csrf-1", drain=False)
    assert _post(site, "/ui/runs/csrf-1/abort", "anything").status_code == 401
    form = site.http.get("/ui/login")
    assert _post(site, "/ui/login", None, key=FULL).status_code == 403  # the sign-in form's token too
    assert (
        site.http.post(
            "/ui/login",
            data={"key": FULL, "csrf_token": _token(form.text)},
            headers={"origin": "http://evil.example"},
            follow_redirects=False,
        ).status_code
        == 403
    )
    token = _sign_in(site)
    missing = _post(site, "/ui/runs/csrf-1/abort", None)
    assert missing.status_code == 403 and "CSRF token missing or invalid" in missing.text
    assert _post(site, "/ui/runs/csrf-1/abort", token[::-1]).status_code == 403
    foreign = site.http.post(
        "/ui/runs/csrf-1/abort",
        data={"csrf_token": token},
        headers={"origin": "http://evil.example"},
        follow_redirects=False,
    )
    assert foreign.status_code == 403
    assert not site.store.load("csrf-1").aborted  # type: ignore[union-attr]  # the run exists
    same = site.http.post(
        "/ui/runs/csrf-1/abort",
        data={"csrf_token": token},
        headers={"origin": "http://testserver"},
        follow_redirects=False,
    )
    assert same.status_code == 303
    out = _post(site, "/ui/logout", token)
    assert out.status_code == 303 and out.headers["location"] == "/ui/login"
    assert site.http.get("/ui/runs", follow_redirects=False).status_code == 303


def test_a_read_only_key_sees_no_forms_and_may_not_act(site: Site) -> None:
    site.start("desk", "ro-1", "refund 5")
    token = _sign_in(site, READER)
    page = site.http.get("/ui/runs/ro-1")
    assert page.status_code == 200 and 'data-status="awaiting-approval"' in page.text
    for form in ('class="decide"', 'id="abort"', 'id="resume"', 'id="fork"'):
        assert form not in page.text, form
    assert _post(site, "/ui/runs/ro-1/abort", token).status_code == 403
    approval_id = site.client.approvals.list()[0].approval_id
    assert _post(site, f"/ui/approvals/{approval_id}", token, decision="approve").status_code == 403
    assert site.client.approvals.list()[0].status == "pending"


def test_an_agent_scoped_key_sees_only_its_agents_runs(site: Site) -> None:
    site.start("desk", "scope-desk", "refund 5")
    site.start("hooks", "scope-hooks")
    _sign_in(site, DESK_ONLY)
    listed = site.http.get("/ui/runs").text
    assert 'data-run-id="scope-desk"' in listed and 'data-run-id="scope-hooks"' not in listed
    assert '<option value="hooks"' not in listed
    assert site.http.get("/ui/runs?agent=hooks").text.count('class="run"') == 0
    for path in ("/ui/runs/scope-hooks", "/ui/runs/scope-hooks/live", "/ui/compare?a=scope-desk&b=scope-hooks"):
        assert site.http.get(path).status_code == 404, path
    inbox = site.http.get("/ui/approvals").text
    assert 'href="/ui/runs/scope-desk"' in inbox


def test_a_runs_text_is_escaped(site: Site) -> None:
    site.start("scripty", "xss-1", "<img src=x onerror=alert(2)>")
    _sign_in(site)
    page = site.http.get("/ui/runs/xss-1").text
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(2)&gt;" in page
    assert re.search(r"<script(?! src=\"/ui/static/ui.js\" defer>)", page) is None  # no inline script at all


def test_the_run_page_shows_steps_tool_calls_results_and_usage(site: Site) -> None:
    site.start("hooks", "steps-1", "handle it")
    _sign_in(site)
    page = site.http.get("/ui/runs/steps-1")
    text = page.text
    assert '<h1>Run <span class="run-id">steps-1</span></h1>' in text
    assert 'id="run-status" data-status="finished"' in text and 'id="finish-reason">stop<' in text
    assert '<span id="run-agent">hooks</span>' in text
    assert '<li class="input"><span class="label">Input</span><div class="input-text">handle it</div>' in text
    assert 'data-step="1"' in text and 'data-step="2"' in text
    call = re.search(r'<div class="tool-call" data-call-id="([^"]+)">(.*?)</div>\s*</li>', text, re.S)
    assert call, "no tool call on the page"
    assert '<span class="tool-name">note</span>' in call.group(2)
    assert '"text": "hi"' in call.group(2).replace("&#34;", '"')
    assert "noted hi" in call.group(2) and 'class="tool-duration"' in call.group(2)
    assert 'class="usage"' in text
    assert '<div class="model-text">Done.</div>' in text
    assert 'class="flower" href="http://flower.test:5555/tasks?search=steps-1"' in text
    assert 'id="abort"' not in text and 'id="resume"' not in text  # finished: nothing to stop or resume
    assert 'id="fork"' in text and 'id="compare-link" href="/ui/compare?a=steps-1"' in text


def test_the_run_page_shows_the_business_state_escaped(site: Site) -> None:
    site.client.agent("hooks").send("handle it", "state-1", business_state={"order": "<b>7</b>", "paid": True})
    site.driver.drain()
    _sign_in(site)
    text = site.http.get("/ui/runs/state-1").text
    shown = re.search(r'<details id="business-state"[^>]*>.*?<pre>(.*?)</pre>', text, re.S)
    assert shown, "no business state on the page"
    assert "<b>" not in shown.group(1) and '"paid": true' in shown.group(1).replace("&#34;", '"')
    site.start("hooks", "state-none")
    page = site.http.get("/ui/runs/state-none").text
    assert 'id="run-status"' in page and 'id="business-state"' not in page  # a run without one shows none


def test_approving_and_rejecting_with_a_note_through_the_form(site: Site) -> None:
    site.start("desk", "appr-1", "refund 5")
    site.start("desk", "appr-2", "refund 5")
    token = _sign_in(site)
    page = site.http.get("/ui/runs/appr-1").text
    pending = {a.session_id: a.approval_id for a in site.client.approvals.list()}
    assert f'data-approval-id="{pending["appr-1"]}"' in page and 'value="approve"' in page and 'name="note"' in page
    done = _post(
        site, f"/ui/approvals/{pending['appr-1']}", token, decision="approve", note="fine", next="/ui/runs/appr-1"
    )
    assert done.status_code == 303 and done.headers["location"] == "/ui/runs/appr-1"
    site.driver.drain()
    assert site.store.load("appr-1").status == "finished"  # type: ignore[union-attr]  # the run exists
    page = site.http.get("/ui/runs/appr-1").text
    assert "refunded 5" in page and 'class="decide"' not in page and "Note: fine" in page
    rejected = _post(
        site, f"/ui/approvals/{pending['appr-2']}", token, decision="reject", note="too <much>", next="/ui/approvals"
    )
    assert rejected.status_code == 303 and rejected.headers["location"] == "/ui/approvals"
    site.driver.drain()
    page = site.http.get("/ui/runs/appr-2").text
    assert "too &lt;much&gt;" in page and 'class="tool-result error"' in page
    again = _post(site, f"/ui/approvals/{pending['appr-2']}", token, decision="approve")
    assert again.status_code == 409
    assert _post(site, "/ui/approvals/no-such", token, decision="approve").status_code == 404


def test_answering_a_question_from_the_inbox(site: Site) -> None:
    site.start("asker", "ask-1", "book a trip")
    token = _sign_in(site)
    inbox = site.http.get("/ui/approvals").text
    approval_id = site.client.approvals.list()[0].approval_id
    assert f'data-approval-id="{approval_id}"' in inbox and '<p class="question">Which city?</p>' in inbox
    assert 'name="answer"' in inbox and 'value="decline"' in inbox and '<span class="agent">asker</span>' in inbox
    assert _post(site, f"/ui/approvals/{approval_id}", token, decision="answer", answer="").status_code == 400
    done = _post(site, f"/ui/approvals/{approval_id}", token, decision="answer", answer="Oslo", next="/ui/approvals")
    assert done.status_code == 303
    site.driver.drain()
    assert 'class="empty"' in site.http.get("/ui/approvals").text
    page = site.http.get("/ui/runs/ask-1").text
    assert "booked" in page and "Oslo" in page and 'data-status="finished"' in page


def test_deciding_a_reconciliation_from_the_inbox(site: Site, leases: LeaseManager, redis_client: Any) -> None:
    site.start("till", "till-1", "charge order 7", drain=False)
    die_at("after_once_effect_before_result_save", "till-1", leases, site.driver.drain)
    site.driver.queue.clear()
    redis_client.delete(keys.lease_key("till-1"))  # the dead worker's lease expired
    site.driver.enqueue("till-1", None)
    site.driver.drain()
    token = _sign_in(site)
    inbox = site.http.get("/ui/approvals").text
    asked = site.client.approvals.list()[0]
    assert asked.kind == "reconcile" and f'data-approval-id="{asked.approval_id}"' in inbox
    assert "Did it take effect?" in inbox and 'value="answer"' in inbox and 'value="approve"' in inbox
    assert 'value="reject"' in inbox
    done = _post(
        site,
        f"/ui/approvals/{asked.approval_id}",
        token,
        decision="reject",
        note="never reached the bank",
        next="/ui/approvals",
    )
    assert done.status_code == 303
    site.driver.drain()
    page = site.http.get("/ui/runs/till-1").text
    assert "never reached the bank" in page and 'data-status="finished"' in page


def test_abort_and_resume_from_the_page(site: Site) -> None:
    site.start("hooks", "stop-1", drain=False)
    token = _sign_in(site)
    page = site.http.get("/ui/runs/stop-1").text
    assert 'data-status="running"' in page and 'id="abort"' in page and 'id="resume"' not in page
    assert _post(site, "/ui/runs/stop-1/abort", token).headers["location"] == "/ui/runs/stop-1"
    site.driver.drain()
    page = site.http.get("/ui/runs/stop-1").text
    assert 'data-status="aborted"' in page and 'id="resume"' in page and 'id="abort"' not in page
    assert _post(site, "/ui/runs/stop-1/resume", token).status_code == 303
    site.driver.drain()
    assert 'data-status="finished"' in site.http.get("/ui/runs/stop-1").text
    site.start("broken", "park-1")
    page = site.http.get("/ui/runs/park-1").text
    assert 'data-status="parked"' in page and 'id="resume"' in page and 'id="last-error"' in page
    assert _post(site, "/ui/runs/park-1/resume", token).status_code == 303
    assert site.driver.queue, "the resume sent a step"


def test_fork_from_a_step_with_a_patch_and_compare(site: Site) -> None:
    site.start("chooser", "pick-1", "pick a shade")
    token = _sign_in(site)
    page = site.http.get("/ui/runs/pick-1").text
    assert all(f'<option value="{n}"' in page for n in (1, 2, 3))
    call_id = site.store.load("pick-1").messages[-2].tool_call_id  # type: ignore[union-attr]  # the run exists
    patch = json.dumps({"tool_result": {"tool_call_id": call_id, "result": "teal"}})
    made = _post(site, "/ui/runs/pick-1/fork", token, step="2", patch=patch, new_id="pick-1-teal")
    assert made.status_code == 303 and made.headers["location"] == "/ui/compare?a=pick-1&b=pick-1-teal"
    site.driver.drain()
    assert site.store.load("pick-1-teal").messages[-1].content == "chose teal"  # type: ignore[union-attr]
    compare = site.http.get(made.headers["location"]).text
    assert '<p id="divergence">diverge at step 2</p>' in compare  # numbered from 1, as history and forks are
    for side in ("side-a", "side-b"):
        column = compare.split(f'id="{side}"')[1].split("</section>")[0]
        assert column.count("data-index=") == 3
        assert re.search(r'class="step diverged" data-index="2"', column)
        assert 'class="step diverged" data-index="1"' not in column
    assert "no divergence" in site.http.get("/ui/compare?a=pick-1&b=pick-1").text
    assert _post(site, "/ui/runs/pick-1/fork", token, step="2", patch="[1]").status_code == 400
    assert _post(site, "/ui/runs/pick-1/fork", token, step="99").status_code == 409
    taken = _post(site, "/ui/runs/pick-1/fork", token, step="2", new_id="pick-1-teal")
    assert taken.status_code == 409


def test_the_live_endpoint_follows_the_run(site: Site) -> None:
    site.start("hooks", "live-1", drain=False)
    _sign_in(site)
    before = site.http.get("/ui/runs/live-1/live")
    assert before.status_code == 200
    body = before.json()
    assert body["status"] == "running" and body["settled"] is False
    assert 'data-live-url="/ui/runs/live-1/live"' in site.http.get("/ui/runs/live-1").text
    site.driver.drain()
    after = site.http.get("/ui/runs/live-1/live").json()
    assert after["status"] == "finished" and after["settled"] is True and after["version"] != body["version"]
    assert 'data-status="finished"' in after["html"] and "noted hi" in after["html"]
    site.http.cookies.clear()
    assert site.http.get("/ui/runs/live-1/live", follow_redirects=False).status_code == 303


def _count_describes(site: Site, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The runs ``describe`` is asked about from now on, in order (the pages' client is the site's)."""
    asked: list[str] = []
    describe = site.client.describe

    def counted(session_id: str) -> RunSummary | None:
        asked.append(session_id)
        return describe(session_id)

    monkeypatch.setattr(site.client, "describe", counted)
    return asked


def _why(page: str) -> str:
    found = re.search(r'<section id="why".*?</section>', page, re.S)
    assert found, "no why on the page"
    return found.group(0)


def test_an_unfinished_runs_page_says_why_as_describe_does_and_a_finished_ones_says_nothing(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    site.start("desk", "why-appr", "refund 5")
    site.start("hooks", "why-done")
    site.start("hooks", "why-stuck", drain=False)  # its step waits in the driver's queue: no broker holds it
    _sign_in(site)
    asked = _count_describes(site, monkeypatch)

    # A run awaiting approval: its state, a link to each approval's card on the page, and its next action
    page = site.http.get("/ui/runs/why-appr").text
    told = site.client.describe("why-appr")
    assert told is not None and told.waiting_on is not None and told.next_action
    why = _why(page)
    assert f'data-state="{told.state}"' in why and told.state == "awaiting-approval"
    assert told.waiting_on.approval_ids
    for approval_id in told.waiting_on.approval_ids:
        assert f'href="#approval-{approval_id}"' in why and f'id="approval-{approval_id}"' in page
    assert f'<span id="next-action">{escape(told.next_action)}</span>' in why
    assert page.index('id="why"') < page.index('id="run-status"'), "the why is not at the top"

    # A run nothing moves, whose agent no live worker serves (the driver is no worker): that agent, and the sweep
    page = site.http.get("/ui/runs/why-stuck").text
    told = site.client.describe("why-stuck")
    assert told is not None and told.waiting_on is not None and told.next_action
    assert told.state == "running" and told.waiting_on.unserved_agent == "hooks"
    why = _why(page)
    assert 'class="unserved" data-agent="hooks"' in why and 'data-state="running"' in why
    assert f'<span id="next-action">{escape(told.next_action)}</span>' in why

    # A finished run: no why, and it is not described
    page = site.http.get("/ui/runs/why-done").text
    assert 'data-status="finished"' in page and 'id="why"' not in page
    assert asked == ["why-appr", "why-appr", "why-stuck", "why-stuck"]


def test_the_live_endpoint_describes_a_run_again_only_when_its_version_changed(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    site.start("desk", "why-live", "refund 5")
    token = _sign_in(site)
    asked = _count_describes(site, monkeypatch)
    page = site.http.get("/ui/runs/why-live").text
    version = re.search(r'data-version="([^"]+)"', page)
    assert version and 'id="why"' in page and asked == ["why-live"]

    # While the run stays at the version the page shows, a live refresh neither describes it nor renders it
    same = site.http.get("/ui/runs/why-live/live", params={"version": version.group(1)}).json()
    assert same["version"] == version.group(1) and same["html"] is None and asked == ["why-live"]
    older = site.http.get("/ui/runs/why-live/live", params={"version": "0" * 32}).json()
    assert 'id="why"' in older["html"] and asked == ["why-live"] * 2
    assert 'id="why"' in site.http.get("/ui/runs/why-live/live").json()["html"] and len(asked) == 3

    # Once it finishes, the refresh drops the why without describing it
    approval_id = site.client.approvals.list()[0].approval_id
    assert _post(site, f"/ui/approvals/{approval_id}", token, decision="approve").status_code == 303
    site.driver.drain()
    done = site.http.get("/ui/runs/why-live/live", params={"version": version.group(1)}).json()
    assert done["status"] == "finished" and done["version"] != version.group(1)
    assert 'id="why"' not in done["html"] and len(asked) == 3


def test_a_runs_page_still_shows_when_what_it_waits_on_cannot_be_read(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    site.start("desk", "why-down", "refund 5")
    _sign_in(site)

    def unreadable(session_id: str) -> RunSummary | None:
        raise errors.StorageError("Redis unavailable: ConnectionError")

    monkeypatch.setattr(site.client, "describe", unreadable)
    answer = site.http.get("/ui/runs/why-down")
    assert answer.status_code == 200 and 'id="run-status" data-status="awaiting-approval"' in answer.text
    assert 'id="why-unavailable"' in answer.text and 'id="why"' not in answer.text


def test_the_runs_list_pages_filters_and_searches(site: Site) -> None:
    for n in range(53):
        site.client.store.append_input(f"many-{n:02d}", "hooks", [Message(role="user", content="x")])
    site.start("desk", "wait-1", "refund 5")
    _sign_in(site)
    first = site.http.get("/ui/runs").text
    assert first.count('class="run"') == 50 and 'rel="next"' in first and 'rel="prev"' not in first
    assert first.index('data-run-id="wait-1"') < first.index('data-run-id="many-52"')  # newest first
    older = re.search(r'rel="next" href="([^"]+)"', first)
    assert older is not None
    second = site.http.get(html.unescape(older.group(1))).text
    assert second.count('class="run"') == 4 and 'rel="prev"' in second and 'rel="next"' not in second
    waiting = site.http.get("/ui/runs?status=awaiting-approval").text
    assert waiting.count('class="run"') == 1 and '<td class="status"><span class="status-awaiting-approval">' in waiting
    assert site.http.get("/ui/runs?agent=desk").text.count('class="run"') == 1
    assert site.http.get("/ui/runs?q=ny-5").text.count('class="run"') == 3
    assert 'class="empty"' in site.http.get("/ui/runs?q=nothing-like-it").text
    assert re.search(r'<time datetime="\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ">', first)


def test_the_runs_list_reads_no_transcript(site: Site) -> None:
    site.start("hooks", "talk-1", "handle it")
    _sign_in(site)
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        statements.append(statement)

    event.listen(site.client.engine, "before_cursor_execute", seen)
    try:
        page = site.http.get("/ui/runs?status=finished")
    finally:
        event.remove(site.client.engine, "before_cursor_execute", seen)
    assert 'data-run-id="talk-1"' in page.text
    listing = [s for s in statements if re.search(r"\bFROM runs\b", s)]
    assert listing, statements
    assert [s for s in statements if "run_messages" in s] == []  # no transcript rows
    # nor the document (a format-1 run keeps its transcript there): at most a stopped run's finish reason
    assert [s for s in listing if re.search(r"\bdocument\b(?! ->> 'finish_reason')", s)] == []


def test_the_runs_list_pages_by_keyset_while_runs_are_created(site: Site) -> None:
    for n in range(120):
        site.client.store.append_input(f"page-{n:03d}", "hooks", [Message(role="user", content="x")])
    _sign_in(site)
    listed: list[str] = []
    page = site.http.get("/ui/runs").text
    for pages in range(1, 10):
        listed.extend(re.findall(r'data-run-id="([^"]+)"', page))
        # A run created while the viewer reads moves nothing on the older pages.
        site.client.store.append_input(f"late-{pages}", "hooks", [Message(role="user", content="x")])
        older = re.search(r'rel="next" href="([^"]+)"', page)
        if older is None:
            break
        assert "cursor=" in older.group(1) and "page=" not in older.group(1)
        page = site.http.get(html.unescape(older.group(1))).text
    assert listed == [f"page-{n:03d}" for n in reversed(range(120))]
    assert 'rel="next"' not in page
    # Back one page: the fifty runs just newer than the last page, and a way on to the runs created since.
    newer = re.search(r'rel="prev" href="([^"]+)"', page)
    assert newer is not None
    back = site.http.get(html.unescape(newer.group(1))).text
    assert re.findall(r'data-run-id="([^"]+)"', back) == listed[50:100]
    assert 'rel="prev"' in back and 'rel="next"' in back
    assert site.http.get("/ui/runs?cursor=not-a-cursor").status_code == 400


def test_webhooks_can_be_turned_off_and_need_no_secret_then(
    settings: Settings, store: PostgresCheckpointStore, leases: LeaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(errors.ConfigurationError):
        WebhookConfig.from_settings(settings.model_copy(update={"webhook_secrets": SecretStr("")}))
    config = WebhookConfig.from_settings(
        settings.model_copy(
            update={"webhook_secrets": SecretStr(""), "webhooks_enabled": False, "api_keys": SecretStr(KEYS)}
        )
    )
    assert config.intake is False
    for site in _build(settings, store, leases, monkeypatch, config):
        assert (
            site.http.post("/webhooks/hooks", content=b"{}", headers={"content-type": "application/json"}).status_code
            == 404
        )
        assert site.http.get("/ui/login").status_code == 200
        assert site.http.get("/healthz").status_code == 200


def test_a_proxy_header_signs_in_only_on_requests_from_the_proxy(
    settings: Settings, store: PostgresCheckpointStore, leases: LeaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = WebhookConfig(secrets=(key(SECRET),), api_keys=SecretStr(KEYS))
    proxied = {"x-forwarded-email": "ana@example.com"}
    # TestClient's requests come from the address "testclient".
    for site in _build(
        settings,
        store,
        leases,
        monkeypatch,
        config,
        ui_proxy_user_header="X-Forwarded-Email",
        ui_proxy_access="read",
        ui_proxy_addresses="10.0.0.7",
    ):
        refused = site.http.get("/ui/runs", headers=proxied, follow_redirects=False)
        assert refused.status_code == 303 and refused.headers["location"].startswith("/ui/login")
    for site in _build(
        settings,
        store,
        leases,
        monkeypatch,
        config,
        ui_proxy_user_header="X-Forwarded-Email",
        ui_proxy_access="read",
        ui_proxy_addresses="10.0.0.7, testclient",
    ):
        page = site.http.get("/ui/runs", headers=proxied, follow_redirects=False)
        assert page.status_code == 200 and "ana@example.com" in page.text
        assert site.http.get("/ui/runs", follow_redirects=False).status_code == 303  # no header, no session
