"""The run pages under ``/ui``: sign-in, the runs list, a run's page and its actions, the inbox, compare, live.

Each handler checks the viewer's scope (a run of an agent they do not see is 404) and runs blocking store calls
in the thread pool; what a page shows is built by ``producer.ui.views``.

Stays whole: the pages' URL map, one thin handler per route over ``views``; split, the map would scatter.
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.parse
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse

from producer.client import Client, continue_after
from producer.http import events
from producer.http import routes as wh_routes
from producer.http.access import Principal
from producer.http.backend import Backend
from producer.http.rejections import Rejected
from producer.trajectories import compare_trajectories
from producer.ui import app as pages
from producer.ui import drawing, runs_list, sessions, spend, tree, views, why
from store import errors, inputs, records
from store.records import Checkpoint

router = APIRouter(prefix="/ui")
#: ``Principal.sees``: whether the viewer sees an agent's runs.
_Sees = Callable[[str | None], bool]

_STATIC_TYPES = {"ui.js": "text/javascript; charset=utf-8", "ui.css": "text/css; charset=utf-8"}
_AGENT = re.compile(r"[A-Za-z0-9_-]{1,100}")
#: Durable events a run page reads at most (for durations, usage and drift).
EVENTS_LIMIT = 2000


def _cookie(response: Response, request: Request, name: str, value: str, max_age: int | None) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=sessions.COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def _client(backend: Backend) -> Client:
    if backend.client is None:
        raise pages.PageError(501, "This server cannot act on runs")
    return backend.client


def _load(backend: Backend, principal_sees: _Sees, run_id: str) -> Checkpoint:
    """The visible run ``run_id`` (404 otherwise)."""
    try:
        records.validate_session_id(run_id)
        checkpoint = backend.checkpoints.load(run_id)
    except errors.SessionIdInvalidError:
        pages.not_found()
    except errors.CheckpointCorruptError:
        raise pages.PageError(500, "This run's stored state cannot be read") from None
    if checkpoint is None or not principal_sees(checkpoint.agent):
        pages.not_found()
    return checkpoint


# -- sign-in -------------------------------------------------------------------------------------------------


def _login_page(request: Request, status: int, error: str | None, next_path: str) -> Response:
    cookie, token = pages.signer_of(request).login_cookie()
    response = pages.render(
        "login.html", request, None, status_code=status, login_token=token, error=error, next_path=next_path
    )
    _cookie(response, request, sessions.LOGIN_COOKIE, cookie, sessions.LOGIN_FORM_S)
    return response


@router.get("/login")
async def login_form(request: Request) -> Response:
    """The sign-in form (straight to the runs when already signed in)."""
    pages.check_enabled(request)
    next_path = pages.safe_next(request.query_params.get("next"))
    if pages.viewer(request) is not None:
        return pages.redirect(next_path)
    return _login_page(request, 200, None, next_path)


@router.post("/login")
async def login(request: Request) -> Response:
    """Sign in with an API key: a session cookie (never the key) and off to ``next``."""
    pages.check_enabled(request)
    pages.check_origin(request)
    form = await pages.read_form(request)
    signer = pages.signer_of(request)
    if not signer.login_token_ok(request.cookies.get(sessions.LOGIN_COOKIE), form.get("csrf_token")):
        raise pages.PageError(403, pages.CSRF_REFUSED)
    next_path = pages.safe_next(form.get("next"))
    principal = pages.config_of(request).keys.find(form.get("key", "")) if form.get("key", "").strip() else None
    if principal is None:
        return _login_page(request, 401, "That key is not valid", next_path)
    hours = pages.settings_of(request).ui_session_hours
    value, _ = signer.session_cookie(principal, hours)
    response = pages.redirect(next_path)
    _cookie(response, request, sessions.SESSION_COOKIE, value, int(hours * 3600))
    response.delete_cookie(sessions.LOGIN_COOKIE, path=sessions.COOKIE_PATH)
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    """Sign out: the session cookie is cleared."""
    await pages.acting(request, read_ok=True)
    response = pages.redirect("/ui/login")
    response.delete_cookie(
        sessions.SESSION_COOKIE,
        path=sessions.COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.get("/static/{name}")
async def static(name: str, request: Request) -> Response:
    """The pages' script and style sheet."""
    pages.check_enabled(request)
    if name not in _STATIC_TYPES:
        pages.not_found("file")
    return FileResponse(
        pages.STATIC_DIR / name,
        media_type=_STATIC_TYPES[name],
        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"},
    )


@router.get("")
@router.get("/")
async def home(request: Request) -> Response:
    """``/ui``: the runs list."""
    pages.signed_in(request)
    return pages.redirect("/ui/runs")


# -- runs ----------------------------------------------------------------------------------------------------


def _runs(
    backend: Backend, agents: frozenset[str] | None, status: str, query: str, cursor: str | None, since: datetime | None
) -> tuple[records.RunsPage, dict[records.ListedState, int], list[str]]:
    """One page of the runs list and the counts by state of the runs of its agents and time, read by the store.

    Neither reads a transcript: the page is one keyset statement, the counts one ``GROUP BY``.
    """
    page = backend.checkpoints.list_runs(
        agents=agents,
        states=views.states_of(status),
        id_contains=query or None,
        since=since,
        limit=views.PAGE_SIZE,
        cursor=cursor,
    )
    return page, backend.checkpoints.count_runs(agents=agents, since=since), backend.known_agents()


@router.get("/runs")
async def runs(request: Request) -> Response:
    """The runs the viewer sees, newest first by creation, filtered by agent, status, id and creation time, 50 a page.

    Above them, how many of the runs of those agents and that time stand in each state, each count a link.

    Pages follow each other by cursor (the last run shown), so runs created while the viewer reads do not push
    the runs of the next page onto the one already seen. ``since`` is a window (``1h``, ``24h``, ``7d``, ``30d``)
    or an ISO-8601 time with its offset.
    """
    found = pages.signed_in(request)
    params = request.query_params
    agent = params.get("agent", "").strip()
    status = params.get("status", "").strip()
    query = params.get("q", "").strip()[:200]
    cursor = params.get("cursor", "").strip()[:2000] or None
    if agent and not _AGENT.fullmatch(agent):
        agent = ""
    status = views.status_filter(status)
    principal = found.principal
    agents = principal.agents if not agent else frozenset({agent} if principal.sees(agent) else ())
    since = runs_list.since_of(params.get("since", ""), datetime.now(UTC))
    try:
        page, counted, known = await run_in_threadpool(
            _runs, pages.backend_of(request), agents, status, query, cursor, since.at
        )
    except errors.ConfigurationError:
        raise pages.PageError(400, "That page of runs cannot be found: start from the first page") from None
    listed = principal.visible(set(known) | {run.agent for run in page.items} | ({agent} if agent else set()))

    def link(at: str | None) -> str | None:
        if at is None:
            return None
        kept = {k: v for k, v in (("agent", agent), ("status", status), ("q", query), ("since", since.value)) if v}
        return "/ui/runs?" + urllib.parse.urlencode({**kept, "cursor": at})

    return pages.render(
        "runs.html",
        request,
        found,
        rows=views.run_rows(page),
        agents=listed,
        statuses=views.STATUSES,
        agent=agent,
        status=status,
        query=query,
        since=since,
        windows=runs_list.WINDOWS,
        total=sum(counted.values()),
        counts=runs_list.state_counts(counted, {"agent": agent, "q": query, "since": since.value}),
        all_link=runs_list.listing_link({"agent": agent, "q": query, "since": since.value}),
        next_link=link(page.next_cursor),
        prev_link=link(page.prev_cursor),
    )


def _run_data(
    backend: Backend, principal: Principal, run_id: str, with_history: bool, known_version: str | None = None
) -> dict[str, Any]:
    """What a run's page shows: its state, timeline and drawing, approvals, the runs under it, its usage, and why.

    The why of an unfinished run (``Client.describe``: what it waits on, what moves it next) tops ``_live.html``.
    ``describe`` scans the broker's queues, so it is asked only when the page has not shown this ``version`` of
    the run yet (``known_version``: the one it shows; None on a full load); ``changed`` says whether it was.
    """
    checkpoint = _load(backend, principal.sees, run_id)
    found_events: list[Any] = []
    after = -1
    while len(found_events) < EVENTS_LIMIT:
        page = backend.checkpoints.read_events(run_id, after, 500)
        found_events.extend(page)
        if len(page) < 500:
            break
        after = int(page[-1].seq or 0)
    # The run's approvals: those it waits on, and those its events say it asked for (decided ones included).
    asked = [str(e.data.get("approval_id")) for e in found_events if e.type == "approval.requested"]
    wanted = list(dict.fromkeys([*asked, *checkpoint.approval_ids]))
    approvals = backend.approvals.by_ids(wanted) if wanted else {}
    steps = sorted({entry.step for entry in backend.checkpoints.history(run_id)}) if with_history else []
    status = views.status_of(checkpoint)
    shown = sorted((views.approval_view(a) for a in approvals.values()), key=lambda a: (a.created or "", a.approval_id))
    children = tree.children_of_calls(checkpoint, found_events)
    # Only a run that started children has runs under it: others skip the listing's search.
    under = (
        tree.tree(backend.checkpoints, run_id, principal.agents, views.status_of)
        if children or checkpoint.background
        else tree.Tree([], 0)
    )
    # A digest, short enough for the page to send back in a query string whatever the size of the tree.
    version = hashlib.blake2b(
        (
            f"{checkpoint.seq}:{status}:"
            + ",".join(f"{a.approval_id}={a.status}" for a in shown)
            + ":"
            + tree.version(under)
        ).encode(),
        digest_size=16,
    ).hexdigest()
    changed = version != known_version
    summary, why_error = why.describe(backend.client, run_id, status) if changed else (None, None)
    told = None
    if summary is not None and summary.waiting_on is not None:
        # A lead waits on its children's approvals too: read those its own list did not hold.
        missing = [a for a in summary.waiting_on.approval_ids if a not in approvals]
        waited = {**approvals, **(backend.approvals.by_ids(missing) if missing else {})}
        told = why.why(summary, run_id, waited, under, principal.sees)
    return {
        "run": checkpoint,
        "run_id": run_id,
        "status": status,
        "settled": status in views.SETTLED,
        "timeline": views.timeline(checkpoint, found_events, children),
        "drift": views.drift_notes(found_events),
        "approvals": shown,
        "steps": steps,
        "version": version,
        "can_abort": status in views.ABORTABLE,
        "can_resume": status in views.RESUMABLE,
        "updated": views.iso(checkpoint.updated_at),
        "tree": under,
        "spent": spend.spend(checkpoint.usage, found_events),
        "drawing": drawing.draw(drawing.bars(checkpoint, found_events, approvals.values())),
        "why": told,
        "why_error": why_error,
        "changed": changed,
    }


@router.get("/runs/{run_id}")
async def run_page(run_id: str, request: Request) -> Response:
    """One run: its status, timeline, approvals and actions; it follows the run while it moves."""
    found = pages.signed_in(request)
    data = await run_in_threadpool(_run_data, pages.backend_of(request), found.principal, run_id, True)
    acts = found.principal.acts_on(data["run"].agent)
    return pages.render(
        "run.html",
        request,
        found,
        acts=acts,
        next_path=f"/ui/runs/{urllib.parse.quote(run_id)}",
        lead_id=records.lead_of(run_id),
        **data,
    )


@router.get("/runs/{run_id}/live")
async def run_live(run_id: str, request: Request) -> Response:
    """The moving part of a run's page as JSON: ``status``, ``settled``, ``version`` and ``html``.

    ``?version=`` is the version the page shows: while the run is still at it, ``html`` is null and the run is
    not described again (its why stays as the page shows it).
    """
    found = pages.signed_in(request)
    known = request.query_params.get("version", "")[:64] or None
    data = await run_in_threadpool(_run_data, pages.backend_of(request), found.principal, run_id, False, known)
    acts = found.principal.acts_on(data["run"].agent)
    html = (
        pages.render_fragment(
            "_live.html", request, found, acts=acts, next_path=f"/ui/runs/{urllib.parse.quote(run_id)}", **data
        )
        if data["changed"]
        else None
    )
    return JSONResponse(
        {"status": data["status"], "settled": data["settled"], "version": data["version"], "html": html},
        headers=pages.PAGE_HEADERS,
    )


@router.get("/runs/{run_id}/events")
async def run_events(run_id: str, request: Request) -> Response:
    """The run's events as Server-Sent Events, for the signed-in viewer (as ``GET /runs/{id}/events``)."""
    found = pages.signed_in(request)
    backend = pages.backend_of(request)
    await run_in_threadpool(_load, backend, found.principal.sees, run_id)
    client = _client(backend)
    source = client.events_async(
        run_id, events.resume_after(request), live=events.wants_live(request), executor=request.app.state.event_threads
    )
    return StreamingResponse(events.stream(run_id, source), media_type=events.MEDIA_TYPE, headers=events.STREAM_HEADERS)


# -- actions -------------------------------------------------------------------------------------------------


def _acting_on(backend: Backend, found: pages.Viewer, run_id: str) -> Checkpoint:
    checkpoint = _load(backend, found.principal.sees, run_id)
    if not found.principal.acts_on(checkpoint.agent):
        raise pages.PageError(403, "This key may read runs, not act on them")
    return checkpoint


def _abort(backend: Backend, found: pages.Viewer, run_id: str) -> None:
    _acting_on(backend, found, run_id)
    try:
        _client(backend).abort(run_id)
    except errors.CheckpointNotFoundError:
        pages.not_found()


def _resume(backend: Backend, found: pages.Viewer, run_id: str) -> None:
    checkpoint = _acting_on(backend, found, run_id)
    try:
        _client(backend).agent(checkpoint.agent).resume(run_id)
    except errors.SessionAwaitingApprovalError:
        raise pages.PageError(409, "The run waits on an approval: decide it first") from None
    except errors.SessionBusyError:
        raise pages.PageError(409, "The run is running right now") from None


@router.post("/runs/{run_id}/abort")
async def abort(run_id: str, request: Request) -> Response:
    """Stop the run at its next safe point."""
    found, _ = await pages.acting(request)
    await run_in_threadpool(_abort, pages.backend_of(request), found, run_id)
    return pages.redirect(f"/ui/runs/{urllib.parse.quote(run_id)}")


@router.post("/runs/{run_id}/resume")
async def resume(run_id: str, request: Request) -> Response:
    """Resume a parked, aborted or budget-stopped run."""
    found, _ = await pages.acting(request)
    await run_in_threadpool(_resume, pages.backend_of(request), found, run_id)
    return pages.redirect(f"/ui/runs/{urllib.parse.quote(run_id)}")


def _fork(
    backend: Backend, found: pages.Viewer, run_id: str, step: int, patch: dict[str, Any] | None, new_id: str | None
) -> str:
    checkpoint = _acting_on(backend, found, run_id)
    handle = _client(backend).agent(checkpoint.agent)
    try:
        made = handle.fork(run_id, step, patch, new_id)
    except errors.SessionIdInvalidError:
        raise pages.PageError(400, "The new run id is not a valid run id") from None
    except errors.CheckpointNotFoundError:
        raise pages.PageError(409, "That step is not kept in the run's history") from None
    except errors.ConfigurationError as exc:
        raise pages.PageError(409, exc.message) from None
    try:
        handle.resume(made.session_id)
    except (errors.SessionAwaitingApprovalError, errors.SessionBusyError):
        pass  # the fork exists; its page says where it stands
    return made.session_id


@router.post("/runs/{run_id}/fork")
async def fork(run_id: str, request: Request) -> Response:
    """Fork the run from a kept step (with an optional patch), start the fork, and compare the two."""
    found, form = await pages.acting(request)
    step_text = form.get("step", "").strip()
    if not step_text.isdigit() or len(step_text) > 9:
        raise pages.PageError(400, "Pick a step to fork from")
    patch: dict[str, Any] | None = None
    if form.get("patch", "").strip():
        try:
            parsed = json.loads(form["patch"])
        except ValueError:
            raise pages.PageError(400, "The patch must be a JSON object") from None
        if not isinstance(parsed, dict):
            raise pages.PageError(400, "The patch must be a JSON object")
        patch = parsed
    new_id = form.get("new_id", "").strip() or None
    made = await run_in_threadpool(_fork, pages.backend_of(request), found, run_id, int(step_text), patch, new_id)
    return pages.redirect("/ui/compare?" + urllib.parse.urlencode({"a": run_id, "b": made}))


def _decide(
    backend: Backend, found: pages.Viewer, approval_id: str, decision: str, note: str | None, answer: str | None
) -> str:
    try:
        approval = wh_routes.approval_for(backend, found.principal, approval_id)
    except Rejected as exc:
        if exc.status == 404:
            pages.not_found("approval")
        raise pages.PageError(exc.status, "This key may read runs, not act on them") from None
    approved = {"approve": True, "reject": False, "decline": False, "answer": None}[decision]
    try:
        made = backend.approvals.resolve(approval_id, approved, note, answer if decision == "answer" else None)
    except errors.ApprovalExpiredError:
        backend.publish(approval.session_id, approval.agent)
        raise pages.PageError(410, "The approval expired undecided; it was recorded as rejected") from None
    except errors.ApprovalNotFoundError:
        raise pages.PageError(409, "This approval was already decided") from None
    except errors.ApprovalOrphanedError:
        raise pages.PageError(409, "The approval's run no longer waits on it") from None
    except errors.ConfigurationError as exc:
        raise pages.PageError(400, exc.message) from None
    continue_after(made, backend.publish)
    return approval.session_id


@router.post("/approvals/{approval_id}")
async def approval(approval_id: str, request: Request) -> Response:
    """Approve or reject a gated call (with a note), answer or decline a question, or decide a reconciliation.

    A reconciliation is answered (its result), approved (run again) or rejected (not done). Back to ``next``.
    """
    found, form = await pages.acting(request)
    decision = form.get("decision", "")
    if decision not in ("approve", "reject", "answer", "decline"):
        raise pages.PageError(400, "Choose approve, reject, answer or decline")
    note = form.get("note", "").strip()[: inputs.MAX_NOTE_CHARS] or None
    answer = form.get("answer", "").strip()[: inputs.MAX_NOTE_CHARS]
    if decision == "answer" and not answer:
        raise pages.PageError(400, "Write an answer first")
    run_id = await run_in_threadpool(
        _decide, pages.backend_of(request), found, approval_id, decision, note, answer or None
    )
    return pages.redirect(pages.safe_next(form.get("next"), f"/ui/runs/{urllib.parse.quote(run_id)}"))


# -- inbox and compare ---------------------------------------------------------------------------------------


@router.get("/approvals")
async def inbox(request: Request) -> Response:
    """Every pending approval the viewer sees, oldest first, each decidable in place."""
    found = pages.signed_in(request)
    pending = await run_in_threadpool(pages.backend_of(request).approvals.pending, None)
    shown = [views.approval_view(a) for a in pending if found.principal.sees(a.agent)]
    acting_on = {a.approval_id: found.principal.acts_on(a.agent) for a in shown}
    return pages.render("approvals.html", request, found, approvals=shown, acting_on=acting_on)


def _compare(backend: Backend, principal_sees: _Sees, a: str, b: str | None) -> dict[str, Any]:
    first = _load(backend, principal_sees, a)
    if not b:
        return {"a": a, "b": "", "side_a": None, "side_b": None, "diverged_at": None}
    second = _load(backend, principal_sees, b)
    comparison = compare_trajectories(first, second)
    side_a, side_b = views.compare_sides(comparison)
    return {
        "a": a,
        "b": b,
        "side_a": side_a,
        "side_b": side_b,
        "diverged_at": comparison.diverged_at,
        "status_a": views.status_of(first),
        "status_b": views.status_of(second),
    }


@router.get("/compare")
async def compare(request: Request) -> Response:
    """Two runs side by side, step by step, with where they diverge."""
    found = pages.signed_in(request)
    a, b = request.query_params.get("a", "").strip(), request.query_params.get("b", "").strip()
    if not a:
        return pages.render("compare.html", request, found, a="", b="", side_a=None, side_b=None, diverged_at=None)
    data = await run_in_threadpool(_compare, pages.backend_of(request), found.principal.sees, a, b or None)
    return pages.render("compare.html", request, found, **data)


def mount(app: FastAPI) -> None:
    """Add the run pages under ``/ui`` to ``app`` (each answers 404 while the pages are off or no key is set)."""
    app.include_router(router, include_in_schema=False)  # pages, not JSON routes: not in /openapi.json
    pages.add_handlers(app)


__all__ = ["mount", "router"]
