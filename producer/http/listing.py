"""``GET /runs``, ``DELETE /runs/{session_id}`` and ``GET /approvals``: the operator's JSON routes.

Runs are listed as ``Client.runs`` lists them (the same filters, states and cursors), within the agents the
key sees: a scoped key never learns of another agent's run. Deleting takes an acting key. Every refusal is a
``Rejected`` (one error body for every 4xx, ``producer.http.app``); nothing here echoes the request.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import Query
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from producer import inspection
from producer.http import routes
from producer.http.access import Principal
from producer.http.backend import Backend
from producer.http.rejections import Rejected, bad_request
from store import errors, records
from store.summaries import RunSummary

#: Most approvals ``GET /approvals`` answers with.
APPROVALS_LIMIT = 500


class RunsBody(BaseModel):
    """The answer of ``GET /runs``: a page of runs, newest first, and the cursors on either side of it."""

    model_config = ConfigDict(extra="forbid")

    items: list[RunSummary]
    next_cursor: str | None = None
    prev_cursor: str | None = None


class ApprovalBody(BaseModel):
    """One undecided approval as ``GET /approvals`` lists it."""

    model_config = ConfigDict(extra="forbid")

    approval_id: str
    session_id: str
    agent: str
    kind: str
    tool_name: str
    tool_call_id: str
    args: dict[str, Any]
    question: str | None = None
    options: list[str] | None = None
    created_at: datetime | None = None
    expires_at: datetime | None = None
    #: The runs that lead to it, outermost first (a sub-agent's approval names its lead first).
    run_path: list[str]


class ApprovalsBody(BaseModel):
    """The answer of ``GET /approvals``: undecided approvals, oldest first."""

    model_config = ConfigDict(extra="forbid")

    items: list[ApprovalBody]


class DeletedBody(BaseModel):
    """The answer of ``DELETE /runs/{session_id}``."""

    model_config = ConfigDict(extra="forbid")

    session_id: str
    deleted: bool


#: Why a query is refused, by the field at fault (generic: the request is never echoed).
_REFUSED = {
    "state": f"state takes {', '.join(records.LISTED_STATES)}",
    "since": "since takes a duration (30m, 6h, 2d) or an ISO-8601 time with an offset",
    "cursor": "the cursor is not one a page of runs gave",
    "limit": f"limit takes 1 to {inspection.MAX_LIMIT}",
}


def _split(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def _visible(principal: Principal, wanted: list[str] | None) -> list[str] | None:
    """The agents to list: those asked for (None: any) within those the key sees."""
    if principal.agents is None:
        return wanted
    return sorted(principal.agents if wanted is None else principal.agents & set(wanted))


def _runs(
    backend: Backend,
    agents: list[str] | None,
    states: list[str] | None,
    since: str | None,
    limit: int,
    cursor: str | None,
) -> RunsBody:
    try:
        page = inspection.runs(backend.checkpoints, agents, states, inspection.parse_since(since), limit, cursor)
    except errors.ConfigurationError as exc:
        raise bad_request(_REFUSED.get(str(exc.field), "a filter of the query is not valid")) from None
    return RunsBody(items=page.items, next_cursor=page.next_cursor, prev_cursor=page.prev_cursor)


_Agents = Annotated[list[str] | None, Query(description="only runs of these agents (repeat, or a,b)")]
_States = Annotated[
    list[str] | None,
    Query(description="only runs in these states (repeat, or a,b): " + ", ".join(records.LISTED_STATES)),
]
_Since = Annotated[str | None, Query(max_length=64, description="only runs created since: 30m, 6h, 2d, or a time")]
_Limit = Annotated[int, Query(ge=1, le=inspection.MAX_LIMIT, description="most runs on the page")]
_Cursor = Annotated[str | None, Query(max_length=2000, description="next_cursor or prev_cursor of a page")]
_Agent = Annotated[str | None, Query(max_length=64, description="only this agent's approvals")]


async def list_runs(
    request: Request,
    agent: _Agents = None,
    state: _States = None,
    since: _Since = None,
    limit: _Limit = 50,
    cursor: _Cursor = None,
) -> JSONResponse:
    """``GET /runs``: runs the key sees, finished ones included, newest first, in their state (API key required)."""
    config, backend = routes.state_of(request)
    principal = routes.authorize(request, config)
    agents = _visible(principal, _split(agent))
    body = await run_in_threadpool(_runs, backend, agents, _split(state), since, limit, cursor)
    return JSONResponse(body.model_dump(mode="json"))


def _delete(backend: Backend, principal: Principal, session_id: str) -> None:
    routes.check_access(backend, principal, session_id, act=True)
    if not backend.checkpoints.delete(session_id):
        raise Rejected(404, *routes.NOT_FOUND)


async def delete_run(session_id: str, request: Request) -> JSONResponse:
    """``DELETE /runs/{session_id}``: delete a run and its sub-agents' runs (an acting API key required)."""
    config, backend = routes.state_of(request)
    principal = routes.authorize(request, config)
    await run_in_threadpool(_delete, backend, principal, session_id)
    return JSONResponse(DeletedBody(session_id=session_id, deleted=True).model_dump(mode="json"))


def _approvals(backend: Backend, principal: Principal, agent: str | None) -> ApprovalsBody:
    if agent is not None and not principal.sees(agent):
        return ApprovalsBody(items=[])
    found = backend.approvals.pending(agent, APPROVALS_LIMIT)
    return ApprovalsBody(
        items=[
            ApprovalBody(
                approval_id=a.approval_id,
                session_id=a.session_id,
                agent=a.agent,
                kind=a.kind,
                tool_name=a.tool_name,
                tool_call_id=a.tool_call_id,
                args=a.args,
                question=a.question,
                options=a.options,
                created_at=a.created_at,
                expires_at=a.expires_at,
                run_path=a.run_path,
            )
            for a in found
            if principal.sees(a.agent)
        ]
    )


async def list_approvals(request: Request, agent: _Agent = None) -> JSONResponse:
    """``GET /approvals``: undecided approvals of the runs the key sees, oldest first (API key required)."""
    config, backend = routes.state_of(request)
    principal = routes.authorize(request, config)
    body = await run_in_threadpool(_approvals, backend, principal, agent)
    return JSONResponse(body.model_dump(mode="json"))


__all__ = [
    "APPROVALS_LIMIT",
    "ApprovalBody",
    "ApprovalsBody",
    "DeletedBody",
    "RunsBody",
    "delete_run",
    "list_approvals",
    "list_runs",
]
