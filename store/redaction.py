"""Masks secret-shaped text in logs.

Covers API keys, bearer and basic credentials, webhook secrets, passwords in URLs and in
``key=value`` pairs (query parameters, headers, JSON, environment dumps).

``redact(text)`` is what other modules call on text they store, send or show. ``install()`` masks every log
record of the process as it is created, whatever handler later writes it (handlers configured afterwards,
such as uvicorn's, included), and uncaught exceptions; every process the project starts calls it first.
It imports nothing of the project, so anything may depend on it.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

_MASK = "***"
#: Names whose value is a credential, in ``name=value``, ``name: value`` and ``"name": "value"`` forms.
_SECRET_NAMES = (
    r"api[_-]?key|access[_-]?key|secret[_-]?key|private[_-]?key|client[_-]?secret|secrets?"
    r"|passwords?|passwd|(?:access|refresh|auth|id|session)[_-]?token|token|basic[_-]?auth"
)
_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\b(sk-(?:ant-)?[A-Za-z0-9_\-]{8,})"), "sk-" + _MASK),
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"), "gh_" + _MASK),
    (re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}"), "xox-" + _MASK),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._\-~+/]{8,}=*"), r"\1" + _MASK),
    (
        re.compile(r"(?i)\b(authorization[\"']?\s*[:=]\s*[\"']?(?:basic|bearer|token|digest)?\s*)[^\s\"',;]+"),
        r"\1" + _MASK,
    ),
    (re.compile(r"\bwhsec_[A-Za-z0-9+/=]{8,}"), "whsec_" + _MASK),
    # Database and broker URLs: the password may hold any character but '@' and spaces.
    (re.compile(r"((?:postgres(?:ql)?(?:\+\w+)?|rediss?|amqps?)://[^:/@\s]*:)[^@\s]+@"), r"\1" + _MASK + "@"),
    # Any other URL with credentials (mysql://, https://user:password@host, ...).
    (re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://[^:/@\s]*:)[^@\s/?#]+@"), r"\1" + _MASK + "@"),
    (
        re.compile(rf"(?i)((?<![A-Za-z0-9])(?:{_SECRET_NAMES})[\"']?\s*[:=]\s*[\"']?)(?!\*\*\*)[^\s\"'&,;}}\]]+"),
        r"\1" + _MASK,
    ),
]
_MASKED = "_lousho_masked"


def redact(text: str) -> str:
    """``text`` with every secret-shaped part masked."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def _masked_value(value: Any) -> Any:
    return redact(value) if isinstance(value, str) else value


def mask_record(record: logging.LogRecord) -> None:
    """Mask ``record`` in place: its message, its exception and stack text. Done once per record.

    Arguments keep their shape when masking them one by one is enough (uvicorn's access formatter
    unpacks them); otherwise the record carries the masked final message and no arguments.
    """
    if getattr(record, _MASKED, False):
        return
    setattr(record, _MASKED, True)
    try:
        message = record.getMessage()
    except (TypeError, ValueError, KeyError):
        # The arguments do not fit the format: logging would print them raw with its error report.
        record.msg, record.args = redact(str(record.msg)) + " (log arguments dropped: they did not fit)", None
    else:
        cleaned = redact(message)
        if cleaned != message:
            _mask_message(record, cleaned)
    if record.exc_info and not record.exc_text:
        record.exc_text = logging.Formatter().formatException(record.exc_info)
    if record.exc_text:
        record.exc_text = redact(record.exc_text)
    if record.stack_info:
        record.stack_info = redact(record.stack_info)


def _mask_message(record: logging.LogRecord, cleaned: str) -> None:
    msg, args = _masked_value(record.msg), record.args
    if isinstance(args, tuple):
        args = tuple(_masked_value(a) for a in args)
    elif isinstance(args, dict):
        args = {k: _masked_value(v) for k, v in args.items()}
    try:
        rebuilt = str(msg) % args if args else str(msg)
    except (TypeError, ValueError, KeyError):
        rebuilt = None
    if rebuilt is not None and redact(rebuilt) == rebuilt:
        record.msg, record.args = msg, args
    else:
        record.msg, record.args = cleaned, None


class RedactingFilter(logging.Filter):
    """Masks secrets in a record's final message and its exception text."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Mask the record in place; never drops it."""
        mask_record(record)
        return True


class _MaskingRecordFactory:
    """Wraps the process's log record factory so that every record is masked when it is made."""

    def __init__(self, base: Callable[..., logging.LogRecord]) -> None:
        self.base = base

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.base(*args, **kwargs)
        mask_record(record)
        return record


def _print_masked(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    sys.stderr.write(redact("".join(traceback.format_exception(exc_type, exc, tb))))


def _print_masked_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    name = args.thread.name if args.thread is not None else "?"
    sys.stderr.write(f"Exception in thread {name}:\n")
    _print_masked(args.exc_type, args.exc_value, args.exc_traceback)


def install(logger: logging.Logger | None = None) -> None:
    """Mask secrets in every log record and uncaught exception of this process (safe to call again).

    Args:
        logger: a logger whose handlers also get ``RedactingFilter`` (the root logger by default); the
            masking itself happens when records are made, so handlers added later are covered too.
    """
    target = logger or logging.getLogger()
    if not any(isinstance(f, RedactingFilter) for f in target.filters):
        target.addFilter(RedactingFilter())
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    if not isinstance(logging.getLogRecordFactory(), _MaskingRecordFactory):
        logging.setLogRecordFactory(_MaskingRecordFactory(logging.getLogRecordFactory()))
    # Only Python's own hooks are replaced: one an application installed (an error reporter) stays.
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _print_masked
    if threading.excepthook is threading.__excepthook__:
        threading.excepthook = _print_masked_thread
