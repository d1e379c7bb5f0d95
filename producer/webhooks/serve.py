"""``lousho webhooks serve``: uvicorn running the receiver built from the client's settings, its logs masked.

Owns the server's logging configuration; the app itself is built by ``producer.webhooks.app.create_app``.
"""

from __future__ import annotations

import argparse
import copy
from typing import TYPE_CHECKING, Any

from producer.webhooks.config import WebhookConfig
from store import redaction

if TYPE_CHECKING:
    from producer.client import Client

#: The app factory for uvicorn started by hand: ``uvicorn --factory producer.webhooks.app:create_app``.
APP_FACTORY = "producer.webhooks.app:create_app"


#: Seconds a stopping server waits for open responses (event streams) before it closes them.
GRACEFUL_SHUTDOWN_S = 5


def log_config(level: str) -> dict[str, Any]:
    """Uvicorn's logging configuration with secrets masked on its handlers.

    ``lousho.*`` and library warnings are written through those handlers too (access log lines carry query
    strings, which may hold keys).
    """
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {"redact": {"()": "store.redaction.RedactingFilter"}}
    for handler in config["handlers"].values():
        handler["filters"] = ["redact"]
    config["loggers"]["lousho"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    config["root"] = {"handlers": ["default"], "level": "WARNING"}
    return config


def cmd_serve(client: Client, args: argparse.Namespace) -> int:
    """Run ``lousho webhooks serve``: uvicorn on ``--host``/``--port`` with the environment's settings.

    Raises:
        ConfigurationError: the webhook settings are missing or malformed (checked before the port is bound).
    """
    import uvicorn

    from producer.webhooks.app import create_app

    redaction.install()
    config = WebhookConfig.from_settings(client.settings)  # fail before binding the port when the secrets are wrong
    # Event streams stay open until their run settles: a stop waits this long for them, then closes them.
    uvicorn.run(create_app(config, settings=client.settings), host=args.host, port=args.port, log_level=args.log_level,
                log_config=log_config(args.log_level), server_header=False, date_header=False,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return 0
