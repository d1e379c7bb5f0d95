"""A logging filter that masks secret-shaped text (API keys, bearer tokens, webhook secrets, DSN passwords).

Installed on the handlers of workers, beat and the CLI, so an exception that carries a key or a
connection string never writes it to a log.
"""

from __future__ import annotations

import logging
import re

_PATTERNS = [
    (re.compile(r"\b(sk-(?:ant-)?[A-Za-z0-9_\-]{8,})"), "sk-***"),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._\-~+/]{8,}=*"), r"\1***"),
    (re.compile(r"\bwhsec_[A-Za-z0-9+/=]{8,}"), "whsec_***"),
    (re.compile(r"((?:postgres(?:ql)?(?:\+\w+)?|rediss?|amqps?)://[^:/@\s]*:)[^@\s]+@"), r"\1***@"),
]


def redact(text: str) -> str:
    """``text`` with every secret-shaped part masked."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class RedactingFilter(logging.Filter):
    """Masks secrets in a record's final message and its exception text."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def install(logger: logging.Logger | None = None) -> None:
    """Add the filter to every handler of ``logger`` (the root logger by default) and to the logger."""
    target = logger or logging.getLogger()
    if not any(isinstance(f, RedactingFilter) for f in target.filters):
        target.addFilter(RedactingFilter())
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
