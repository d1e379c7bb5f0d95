"""The receiver's routes: intake of a delivery, a run's status, events, abort and steer, approvals, health.

Owns the API-key check of the run and approval routes and the JSON each route answers; every refusal is
a ``Rejected``, turned into an error body by the app. Blocking store calls run in the thread pool.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from producer.client import Client, continue_after
from producer.http import bodies, events, headers, intake
from producer.http.access import Principal
from producer.http.backend import Backend
from producer.http.config import AGENT_NAME, WebhookConfig
from producer.http.rejections import Rejected, bad_request
from store import errors, inputs, records, telemetry
from store.database import Transaction
from store.records import Approval

_MAX_DECISION_BYTES = 64 * 1024
#: The refusal of a run that is unknown, or that the key does not see.
NOT_FOUND = ("LOUSHO_RUN_NOT_FOUND", "no such run")


class _DecisionBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    approved: bool | None = None
    note: str | None = Field(default=None, max_length=inputs.MAX_NOTE_CHARS)
    #: A question's answer (``ask_question``), or a reconciled call's result; it implies approval.
    answer: str | None = Field(default=None, max_length=inputs.MAX_NOTE_CHARS)


class _SteerBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    message: str = Field(min_length=1)


def state_of(request: Request) -> tuple[WebhookConfig, Backend]:
    """The app's webhook configuration and backend."""
    config: WebhookConfig = request.app.state.config
    backend: Backend = request.app.state.backend
    return config, backend


def authorize(request: Request, config: WebhookConfig) -> Principal:
    """The principal of the request's bearer key.

    Raises:
        Rejected: 401 without a key that matches one configured.
    """
    values = request.headers.getlist("authorization")
    scheme, _, token = (values[0] if len(values) == 1 else "").partition(" ")
    found = config.keys.find(token) if scheme.lower() == "bearer" and token.strip() else None
    if found is None:
        raise Rejected(401, "LOUSHO_API_KEY_INVALID", "a valid API key is required")
    return found


def _agent_of(backend: Backend, session_id: str) -> str | None:
    """The agent of run ``session_id`` (None when the id is invalid or the run unknown)."""
    try:
        records.validate_session_id(session_id)
        progress = backend.checkpoints.progress(session_id)
    except errors.SessionIdInvalidError:
        return None
    return progress.agent if progress is not None else None


def check_access(backend: Backend, principal: Principal, session_id: str, *, act: bool = False) -> None:
    """Refuse a run the principal does not see as unknown (404), and an act by a read-only key (403).

    Raises:
        Rejected: 404 for a run unknown or not seen, 403 for an act by a read-only key.
    """
    agent = _agent_of(backend, session_id)
    if agent is None or not principal.sees(agent):
        raise Rejected(404, *NOT_FOUND)
    if act and not principal.acts_on(agent):
        raise Rejected(403, "LOUSHO_API_KEY_READ_ONLY", "this key may read runs, not act on them")


def _client(backend: Backend) -> Client:
    if backend.client is None:
        raise Rejected(501, errors.ConfigurationError.code, "this server does not serve run events, abort or steer")
    return backend.client


def _abort(client: Client, session_id: str) -> bool:
    try:
        records.validate_session_id(session_id)
        return client.abort(session_id)
    except (errors.SessionIdInvalidError, errors.CheckpointNotFoundError):
        raise Rejected(404, *NOT_FOUND) from None


def _steer(backend: Backend, client: Client, session_id: str, message: str) -> int:
    try:
        records.validate_session_id(session_id)
        checkpoint = backend.checkpoints.load(session_id)
        if checkpoint is None:
            raise Rejected(404, *NOT_FOUND)
        return client.agent(checkpoint.agent).steer(session_id, message).input_number
    except (errors.SessionIdInvalidError, errors.CheckpointNotFoundError):
        raise Rejected(404, *NOT_FOUND) from None
    except errors.SessionAwaitingApprovalError as exc:
        raise Rejected(409, exc.code, "the run waits on an approval; decide it first") from None
    except (errors.CheckpointCorruptError, errors.AgentNotFoundError) as exc:
        raise Rejected(409, exc.code, "the run cannot take input now") from None
    except errors.InputTooLargeError as exc:
        raise Rejected(413, exc.code, "the message is too large") from None


def _run_view(backend: Backend, session_id: str) -> dict[str, Any]:
    try:
        records.validate_session_id(session_id)
        checkpoint = backend.checkpoints.load(session_id)
    except errors.SessionIdInvalidError:
        raise Rejected(404, "LOUSHO_RUN_NOT_FOUND", "no such run") from None
    except errors.CheckpointCorruptError:
        return {"session_id": session_id, "status": "corrupt", "pending_approvals": []}
    if checkpoint is None:
        raise Rejected(404, "LOUSHO_RUN_NOT_FOUND", "no such run")
    approvals = backend.approvals.by_ids(checkpoint.approval_ids)
    pending = [
        a.model_dump(
            mode="json", include={"approval_id", "tool_call_id", "tool_name", "args", "created_at", "kind", "question"}
        )
        for a in approvals.values()
        if a.status == "pending"
    ]
    progress = backend.checkpoints.progress(session_id)
    queued = progress is not None and progress.inbox_head > progress.inbox_cursor
    state = records.listed_state(
        checkpoint.status,
        checkpoint.aborted,
        checkpoint.finish_reason,
        checkpoint.last_error,
        checkpoint.next_attempt_at,
        waiting=checkpoint.waiting,
        queued=queued,
        end_due=checkpoint.end_due,
        own_approvals=any(a.session_id == session_id and a.status == "pending" for a in approvals.values()),
    )
    return {
        "session_id": session_id,
        "agent": checkpoint.agent,
        "state": state,
        "status": checkpoint.status,
        "finish_reason": checkpoint.finish_reason,
        "text": checkpoint.final_text,
        "steps": checkpoint.step,
        "last_error": checkpoint.last_error.model_dump() if checkpoint.last_error else None,
        "pending_approvals": pending,
    }


def _decide(backend: Backend, found: Approval, decision: _DecisionBody) -> tuple[str, bool]:
    approval_id = found.approval_id
    try:
        made = backend.approvals.resolve(approval_id, decision.approved, decision.note, decision.answer)
    except errors.ConfigurationError as exc:
        raise bad_request(exc.message) from None
    except errors.ApprovalExpiredError as exc:
        # Recording the expiry may have let the run continue, and the error says nothing of it: send a step (one
        # for a run still paused does nothing; a lost send is repaired by the recovery sweep).
        backend.publish(found.session_id, found.agent)
        raise Rejected(410, exc.code, "the approval expired undecided; it was recorded as rejected") from None
    except errors.ApprovalNotFoundError:
        raise Rejected(404, "LOUSHO_APPROVAL_NOT_FOUND", "no such pending approval") from None
    except errors.ApprovalOrphanedError:
        raise Rejected(409, "LOUSHO_APPROVAL_ORPHANED", "the approval's run no longer waits on it") from None
    continue_after(made, backend.publish)
    return made.approval.session_id, made.run_continues


def approval_for(backend: Backend, principal: Principal, approval_id: str) -> Approval:
    """The approval ``principal`` may decide (the run pages use it too).

    Raises:
        Rejected: 404 when unknown or of a run the principal does not see, 403 for a read-only key.
    """
    found = backend.approvals.by_ids([approval_id]).get(approval_id) if len(approval_id) <= 200 else None
    if found is None or not principal.sees(found.agent):
        raise Rejected(404, "LOUSHO_APPROVAL_NOT_FOUND", "no such pending approval")
    if not principal.acts_on(found.agent):
        raise Rejected(403, "LOUSHO_API_KEY_READ_ONLY", "this key may read runs, not act on them")
    return found


def _healthy(backend: Backend) -> bool:
    try:
        with Transaction(backend.deliveries.engine) as conn:
            conn.execute(text("SELECT 1"))
    except errors.StorageError:
        return False
    return True


async def receive(agent: str, request: Request) -> JSONResponse:
    """``POST /webhooks/{agent}``: a verified delivery becomes one run (202), exactly once per delivery id."""
    config, backend = state_of(request)
    try:
        if not AGENT_NAME.fullmatch(agent):
            raise Rejected(404, "LOUSHO_AGENT_NOT_FOUND", "no such agent")
        delivery = await intake.verified(request, config, agent, request.app.state.clock())
        session_id, status, duplicate = await run_in_threadpool(intake.accept, backend, config, agent, delivery)
    except Rejected as exc:
        # By reason only: the agent in a refused delivery's path is whatever the sender wrote.
        telemetry.count("webhook.refused", reason=exc.code)
        raise
    telemetry.count("webhook.duplicate" if duplicate else "webhook.accepted", agent=agent, source=delivery.source)
    url = str(request.url_for("run_status", session_id=session_id))
    return JSONResponse(
        {"session_id": session_id, "status": status, "status_url": url, "duplicate": duplicate}, status_code=202
    )


async def run_status(session_id: str, request: Request) -> JSONResponse:
    """``GET /runs/{session_id}``: how a run stands and its pending approvals (API key required)."""
    config, backend = state_of(request)
    principal = authorize(request, config)
    await run_in_threadpool(check_access, backend, principal, session_id)
    return JSONResponse(await run_in_threadpool(_run_view, backend, session_id))


async def run_events(session_id: str, request: Request) -> StreamingResponse:
    """``GET /runs/{session_id}/events``: the run's events as Server-Sent Events (API key required).

    Resumes after ``Last-Event-ID`` or the ``after`` query (else at the run's latest ``run.start``); ``live=1``
    interleaves live signals. Ends with ``event: done`` after the first ``run.done``.
    """
    config, backend = state_of(request)
    principal = authorize(request, config)
    await run_in_threadpool(check_access, backend, principal, session_id)
    client = _client(backend)
    after, live = events.resume_after(request), events.wants_live(request)
    source = client.events_async(session_id, after, live=live, executor=request.app.state.event_threads)
    return StreamingResponse(
        events.stream(session_id, source), media_type=events.MEDIA_TYPE, headers=events.STREAM_HEADERS
    )


async def abort(session_id: str, request: Request) -> JSONResponse:
    """``POST /runs/{session_id}/abort``: stop a run at its next safe point (202), or 200 if it is finished."""
    config, backend = state_of(request)
    principal = authorize(request, config)
    await run_in_threadpool(check_access, backend, principal, session_id, act=True)
    aborting = await run_in_threadpool(_abort, _client(backend), session_id)
    return JSONResponse({"session_id": session_id, "aborting": aborting}, status_code=202 if aborting else 200)


async def steer(session_id: str, request: Request) -> JSONResponse:
    """``POST /runs/{session_id}/steer``: ``{"message": text}`` for the run at its next safe point (202)."""
    config, backend = state_of(request)
    principal = authorize(request, config)
    client = _client(backend)
    await run_in_threadpool(check_access, backend, principal, session_id, act=True)
    headers.check_json_type(request.headers)
    try:
        body = _SteerBody.model_validate(bodies.parse_json(await bodies.read_body(request, config.max_body_bytes)))
    except ValidationError:
        raise bad_request('the body must be {"message": non-empty text}') from None
    number = await run_in_threadpool(_steer, backend, client, session_id, body.message)
    return JSONResponse({"session_id": session_id, "input": number}, status_code=202)


async def approval(approval_id: str, request: Request) -> JSONResponse:
    """``POST /approvals/{approval_id}``: approve or reject a pending tool call (API key required).

    A decision after the approval's expiry is answered 410 ``LOUSHO_APPROVAL_EXPIRED``: it counts as rejected.
    """
    config, backend = state_of(request)
    principal = authorize(request, config)
    headers.check_json_type(request.headers)
    try:
        decision = _DecisionBody.model_validate(bodies.parse_json(await bodies.read_body(request, _MAX_DECISION_BYTES)))
    except ValidationError:
        raise bad_request(
            'the body must be {"approved": true|false, "note": optional text}, or'
            ' {"answer": text} for a question or a reconciliation'
        ) from None
    found = await run_in_threadpool(approval_for, backend, principal, approval_id)
    session_id, continues = await run_in_threadpool(_decide, backend, found, decision)
    return JSONResponse(
        {
            "approval_id": approval_id,
            "session_id": session_id,
            "decision": "answered" if decision.answer is not None else "approved" if decision.approved else "rejected",
            "run_continues": continues,
            "status_url": str(request.url_for("run_status", session_id=session_id)),
        }
    )


async def healthz(request: Request) -> JSONResponse:
    """``GET /healthz``: 200 when Postgres answers, else 503."""
    _, backend = state_of(request)
    ok = await run_in_threadpool(_healthy, backend)
    return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)
