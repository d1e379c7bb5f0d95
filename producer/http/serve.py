"""The HTTP server's logging configuration (uvicorn's, with secrets masked) and its shutdown grace.

``producer.server`` builds the server and runs it (``lousho webhooks serve``).
"""

from __future__ import annotations

import copy
from typing import Any

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
