"""Secret-shaped log lines, emitted from inside a process the project starts (the log-capture test loads this).

``wrap(tag, call)`` is the body of ``python -c``: it arms the emitter (at exit, or on SIGUSR1 for servers),
then runs the project's own entry point. The emitter writes every secret below through several loggers, as
message arguments, inside the message text and inside a traceback, and prints ``MARK tag`` when done.
"""

from __future__ import annotations

import atexit
import logging
import signal
import sys
from typing import Any

MARK = "secret-logs-emitted"
#: Secret-shaped values, and for each the part that must never reach any output.
SECRETS = {
    "openai key": ("sk-proj-Lk3j4h5g6f7d8s9a0ZxQw", "Lk3j4h5g6f7d8s9a0ZxQw"),
    "anthropic key": ("sk-ant-api03-Qm9vYmFyYmF6cXV4", "Qm9vYmFyYmF6cXV4"),
    "bearer token": ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.c2VjcmV0LXRva2Vu", "c2VjcmV0LXRva2Vu"),
    "webhook secret": ("whsec_c2VjcmV0LXNpZ25pbmcta2V5LTEyMzQ=", "c2VjcmV0LXNpZ25pbmcta2V5"),
    "postgres password": ("postgresql://lousho:Pg-Pass-7h6g5f4d@db:5432/lousho", "Pg-Pass-7h6g5f4d"),
    "redis password": ("redis://:Redis-Pass-4d3c2b1a@redis:6379/0", "Redis-Pass-4d3c2b1a"),
    "api_key parameter": ("https://api.example.com/v1/models?api_key=AKx9y8z7w6v5u4&n=1", "AKx9y8z7w6v5u4"),
    "password parameter": ("GET /login?user=ann&password=Hunter2-Pass-0000 HTTP/1.1", "Hunter2-Pass-0000"),
}
LOGGERS = ("", "lousho.webhooks", "lousho.cli", "uvicorn.error", "celery", "sqlalchemy.engine", "httpx")


def emit(tag: str) -> None:
    """Log every secret through every logger in the three ways a secret reaches a log line."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for label, (value, _) in SECRETS.items():
            logger.warning("%s %s: a %s in an argument: %s", tag, name or "root", label, value)
            logger.error(f"{tag} {name or 'root'}: a {label} in the message: {value}")
        try:
            raise RuntimeError(f"{tag}: failed with " + " | ".join(value for value, _ in SECRETS.values()))
        except RuntimeError:
            logger.exception("%s %s: a traceback", tag, name or "root")
    # uvicorn's access formatter unpacks exactly these five arguments.
    logging.getLogger("uvicorn.access").warning(
        '%s - "%s %s HTTP/%s" %d',
        "127.0.0.1:5000",
        "GET",
        "/runs/x?api_key=AKx9y8z7w6v5u4&token=" + SECRETS["openai key"][0],
        "1.1",
        200,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    print(f"{MARK} {tag}", file=sys.stderr, flush=True)


def crash(tag: str) -> None:
    """Leave the process with an uncaught exception whose text carries every secret."""
    raise RuntimeError(f"{tag}: uncaught, with " + " | ".join(value for value, _ in SECRETS.values()))


def wrap(tag: str, call: Any, *, on_signal: bool = False, then_crash: bool = False) -> None:
    """Arm the emitter, run ``call()`` (the project's entry point) and exit with its status."""
    if on_signal:
        signal.signal(signal.SIGUSR1, lambda signum, frame: emit(tag))
    else:
        atexit.register(emit, tag)  # registered after logging's own: runs before logging shuts down
    code = call()
    if then_crash:
        crash(tag)
    sys.exit(code)
