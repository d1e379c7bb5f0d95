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

import redis
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from producer.webhooks import events, routes
from producer.webhooks.backend import Backend
from producer.webhooks.config import WebhookConfig
from producer.webhooks.rejections import Rejected
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


def _metrics(request: Request) -> Response:
    """``GET /metrics``: this server's counts and the approvals gauges, for Prometheus (no key: its convention)."""
    backend: Backend | None = request.app.state.backend
    body, content_type = metrics.render(request.app.state.metrics, backend.approvals.engine if backend else None,
                                        request.headers.get("accept"))
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


def create_app(config: WebhookConfig | None = None, backend: Backend | None = None, *,
               clock: Callable[[], float] = time.time, settings: Settings | None = None) -> FastAPI:
    """The receiver. What is not given is built at startup from ``settings`` (read from the environment if None).

    Routes: ``POST /webhooks/{agent}``; with ``Authorization: Bearer <LOUSHO_API_KEY>``:
    ``GET /runs/{session_id}``, ``GET /runs/{session_id}/events`` (Server-Sent Events),
    ``POST /runs/{session_id}/abort``, ``POST /runs/{session_id}/steer`` and ``POST /approvals/{approval_id}``;
    ``GET /healthz``; ``GET /metrics`` (Prometheus, unauthenticated) when prometheus-client is installed. Intake is
    left out when the configuration turns it off (``LOUSHO_WEBHOOKS_ENABLED=false``); ``producer.server.create_app``
    adds the run pages.

    Raises:
        ConfigurationError: ``config`` takes webhooks without a secret, or has no usable body cap.
    """
    if config is not None:
        config.check()
    app = FastAPI(title="Lousho webhooks", docs_url=None, redoc_url=None, openapi_url=None, lifespan=_lifespan)
    app.state.config, app.state.backend, app.state.clock, app.state.settings = config, backend, clock, settings
    app.state.metrics = metrics.make_sink()
    # The threads that pull run events for ``GET /runs/{id}/events``; a stream holds one while it waits.
    app.state.event_threads = ThreadPoolExecutor(max_workers=events.STREAM_THREADS, thread_name_prefix="lousho-events")
    app.add_exception_handler(Rejected, _on_rejected)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(errors.StorageError, _on_storage)
    app.add_exception_handler(redis.RedisError, _on_storage)
    if config is None or config.intake:
        app.add_api_route("/webhooks/{agent}", _receive, methods=["POST"], status_code=202)
    app.add_api_route("/runs/{session_id}", routes.run_status, methods=["GET"], name="run_status")
    app.add_api_route("/runs/{session_id}/events", routes.run_events, methods=["GET"])
    app.add_api_route("/runs/{session_id}/abort", routes.abort, methods=["POST"])
    app.add_api_route("/runs/{session_id}/steer", routes.steer, methods=["POST"])
    app.add_api_route("/approvals/{approval_id}", routes.approval, methods=["POST"])
    app.add_api_route("/healthz", routes.healthz, methods=["GET"])
    if app.state.metrics is not None:
        app.add_api_route("/metrics", _metrics, methods=["GET"], include_in_schema=False)
    return app
