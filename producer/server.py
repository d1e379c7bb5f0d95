"""The project's HTTP server: intake, JSON routes and run pages on one app, and ``lousho webhooks serve``.

Webhook intake and the JSON routes come from ``producer.http``, the run pages from ``producer.ui``.

Either part can be turned off: ``LOUSHO_WEBHOOKS_ENABLED=false`` leaves intake out, and the pages answer 404
unless ``LOUSHO_UI_ENABLED`` is true and an API key is set.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI

from producer import ui
from producer.http import app as webhooks_app
from producer.http.backend import Backend
from producer.http.config import WebhookConfig
from producer.http.serve import GRACEFUL_SHUTDOWN_S, log_config
from store import redaction
from store.settings import Settings

if TYPE_CHECKING:
    from producer.client import Client

#: The app factory for uvicorn started by hand: ``uvicorn --factory producer.server:create_app``.
APP_FACTORY = "producer.server:create_app"


def create_app(
    config: WebhookConfig | None = None,
    backend: Backend | None = None,
    *,
    clock: Callable[[], float] = time.time,
    settings: Settings | None = None,
) -> FastAPI:
    """The whole server: ``producer.http.app.create_app`` with the run pages mounted under ``/ui``.

    Raises:
        ConfigurationError: ``config`` takes webhooks without a secret, or has no usable body cap.
    """
    app = webhooks_app.create_app(config, backend, clock=clock, settings=settings)
    ui.mount(app)
    return app


def cmd_serve(client: Client, args: argparse.Namespace) -> int:
    """Run ``lousho webhooks serve``: uvicorn on ``--host``/``--port`` with the environment's settings.

    It serves the run pages too when ``LOUSHO_UI_ENABLED`` (the default) and an API key is set; with
    ``LOUSHO_WEBHOOKS_ENABLED=false`` it takes no webhooks and needs no webhook secret.

    Raises:
        ConfigurationError: the webhook settings are missing or malformed (checked before the port is bound).
    """
    import uvicorn

    redaction.install()
    config = WebhookConfig.from_settings(client.settings)  # fail before binding the port when the secrets are wrong
    # Event streams stay open until their run settles: a stop waits this long for them, then closes them.
    uvicorn.run(
        create_app(config, settings=client.settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=log_config(args.log_level),
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return 0


__all__ = ["APP_FACTORY", "cmd_serve", "create_app"]
