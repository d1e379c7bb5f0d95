"""The receiver's ASGI app, built by ``create_app``: routes, error bodies, startup configuration.

Nothing is created at import time; uvicorn serves it, with the run pages, through
``--factory producer.server:create_app``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from producer.http import events, listing, openapi, routes
from producer.http.backend import Backend
from producer.http.config import WebhookConfig
from producer.http.rejections import Rejected
from store import errors, metrics, redaction, telemetry
from store.settings import Settings, load_settings

log = logging.getLogger("lousho.webhooks")


def _error(status: int, code: str, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if code == "LOUSHO_API_KEY_INVALID" else None
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


async def _on_rejected(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Rejected)  # registered for Rejected only
    return _error(exc.status, exc.code, exc.message)


async def _on_invalid(request: Request, exc: Exception) -> JSONResponse:
    return _error(400, "LOUSHO_BAD_REQUEST", "the request is malformed")


#: The codes of the refusals the router itself makes (no route, or not this method), in the one error body.
_HTTP_CODES = {404: ("LOUSHO_NOT_FOUND", "no such route"), 405: ("LOUSHO_METHOD_NOT_ALLOWED", "method not allowed")}


async def _on_http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)  # registered for HTTPException only
    code, message = _HTTP_CODES.get(exc.status_code, (f"LOUSHO_HTTP_{exc.status_code}", "the request was refused"))
    response = _error(exc.status_code, code, message)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


def _version() -> str:
    try:
        return metadata.version("lousho-worker")
    except metadata.PackageNotFoundError:
        return "unknown"


def _metrics(request: Request) -> Response:
    """``GET /metrics``: this server's counts and the approvals gauges, for Prometheus (no key: its convention)."""
    backend: Backend | None = request.app.state.backend
    body, content_type = metrics.render(
        request.app.state.metrics, backend.approvals.engine if backend else None, request.headers.get("accept")
    )
    return Response(body, headers={"Content-Type": content_type})


async def _receive(agent: str, request: Request) -> JSONResponse:
    """``POST /webhooks/{agent}`` while intake is on (a configuration built at startup may turn it off)."""
    config: WebhookConfig | None = request.app.state.config
    if config is not None and not config.intake:
        raise Rejected(404, "LOUSHO_AGENT_NOT_FOUND", "no such agent")
    return await routes.receive(agent, request)


async def _on_storage(request: Request, exc: Exception) -> JSONResponse:
    # A delivery committed before Redis failed is still run: the recover sweep or the redelivery enqueues it.
    log.warning("webhook request failed on a service: %s", type(exc).__name__)
    return _error(503, errors.StorageError.code, "service unavailable, retry later")


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    built = None
    if app.state.config is None or app.state.backend is None:
        # A real server (``lousho webhooks serve`` or uvicorn's factory): settings read once, here or by the caller.
        redaction.install()
        settings: Settings = app.state.settings or load_settings()
        if app.state.config is None:
            app.state.config = WebhookConfig.from_settings(settings)
        if app.state.backend is None:
            app.state.backend = built = Backend.from_settings(settings)
    sink = app.state.metrics
    if sink is not None:
        telemetry.attach(sink)  # for as long as the app serves: deliveries are counted in this process
    try:
        yield
    finally:
        if sink is not None:
            telemetry.detach(sink)
        app.state.event_threads.shutdown(wait=False, cancel_futures=True)
        if built is not None:
            built.close()


def create_app(
    config: WebhookConfig | None = None,
    backend: Backend | None = None,
    *,
    clock: Callable[[], float] = time.time,
    settings: Settings | None = None,
) -> FastAPI:
    """The receiver. What is not given is built at startup from ``settings`` (read from the environment if None).

    Routes: ``POST /webhooks/{agent}``; with ``Authorization: Bearer <LOUSHO_API_KEY>``: ``GET /runs``,
    ``GET /runs/{session_id}``, ``DELETE /runs/{session_id}``, ``GET /runs/{session_id}/events`` (Server-Sent
    Events), ``POST /runs/{session_id}/abort``, ``POST /runs/{session_id}/steer``, ``GET /approvals`` and
    ``POST /approvals/{approval_id}``; ``GET /healthz``; ``GET /openapi.json`` (the JSON routes' OpenAPI 3
    document); ``GET /metrics`` (Prometheus, unauthenticated) when prometheus-client is installed. Every 4xx
    answers ``{"error": {"code", "message"}}``. Intake is
    left out when the configuration turns it off (``LOUSHO_WEBHOOKS_ENABLED=false``); ``producer.server.create_app``
    adds the run pages.

    Raises:
        ConfigurationError: ``config`` takes webhooks without a secret, or has no usable body cap.
    """
    if config is not None:
        config.check()
    app = FastAPI(
        title="Lousho Worker",
        version=_version(),
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=_lifespan,
        description="Webhook intake and the JSON routes of runs, their events and approvals.",
    )
    app.state.config, app.state.backend, app.state.clock, app.state.settings = config, backend, clock, settings
    app.state.metrics = metrics.make_sink()
    # The threads that pull run events for ``GET /runs/{id}/events``; a stream holds one while it waits.
    app.state.event_threads = ThreadPoolExecutor(max_workers=events.STREAM_THREADS, thread_name_prefix="lousho-events")
    app.add_exception_handler(Rejected, _on_rejected)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(errors.StorageError, _on_storage)
    unavailable = openapi.errors(503)
    if config is None or config.intake:
        app.add_api_route(
            "/webhooks/{agent}",
            _receive,
            methods=["POST"],
            status_code=202,
            tags=["intake"],
            summary="Take a signed webhook delivery as one run (exactly once per delivery id)",
            responses={**openapi.errors(400, 401, 404, 409, 413), **unavailable},
        )
    _keyed_route(
        app,
        "GET",
        "/runs",
        listing.list_runs,
        "runs",
        "List runs, finished ones included, newest first, in their state",
        (400, 401),
        response_model=listing.RunsBody,
    )
    _keyed_route(
        app,
        "GET",
        "/runs/{session_id}",
        routes.run_status,
        "runs",
        "How a run stands and its pending approvals",
        (401, 404),
        name="run_status",
    )
    _keyed_route(
        app,
        "DELETE",
        "/runs/{session_id}",
        listing.delete_run,
        "runs",
        "Delete a run and its sub-agents' runs (an acting key)",
        (401, 403, 404),
        response_model=listing.DeletedBody,
    )
    _keyed_route(
        app,
        "GET",
        "/runs/{session_id}/events",
        routes.run_events,
        "runs",
        "The run's events as Server-Sent Events (Last-Event-ID or ?after= resumes)",
        (400, 401, 404),
        stream={200: {"content": {events.MEDIA_TYPE: {}}, "description": "the event stream"}},
    )
    _keyed_route(
        app,
        "POST",
        "/runs/{session_id}/abort",
        routes.abort,
        "runs",
        "Stop a run at its next safe point (an acting key)",
        (401, 403, 404),
    )
    _keyed_route(
        app,
        "POST",
        "/runs/{session_id}/steer",
        routes.steer,
        "runs",
        "Give a run a message it takes at its next safe point (an acting key)",
        (400, 401, 403, 404, 409, 413),
    )
    _keyed_route(
        app,
        "GET",
        "/approvals",
        listing.list_approvals,
        "approvals",
        "Undecided approvals of the runs the key sees, oldest first",
        (400, 401),
        response_model=listing.ApprovalsBody,
    )
    _keyed_route(
        app,
        "POST",
        "/approvals/{approval_id}",
        routes.approval,
        "approvals",
        "Approve, reject or answer an approval (an acting key)",
        (400, 401, 403, 404, 409, 410),
    )
    app.add_api_route(
        "/healthz", routes.healthz, methods=["GET"], tags=["health"], summary="200 when Postgres answers, else 503"
    )
    if app.state.metrics is not None:
        app.add_api_route("/metrics", _metrics, methods=["GET"], include_in_schema=False)
    openapi.install(app)
    return app


def _keyed_route(
    app: FastAPI,
    method: str,
    path: str,
    endpoint: Callable[..., Any],
    tag: str,
    summary: str,
    codes: tuple[int, ...],
    *,
    stream: dict[int | str, Any] | None = None,
    **extra: Any,
) -> None:
    """Add a JSON route that needs an API key, with its error answers (and 503 when a service is down)."""
    app.add_api_route(
        path,
        endpoint,
        methods=[method],
        tags=[tag],
        summary=summary,
        openapi_extra=openapi.keyed(),
        responses={**(stream or {}), **openapi.errors(*codes, 503)},
        **extra,
    )
