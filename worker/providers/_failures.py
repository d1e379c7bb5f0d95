"""Provider failures classified into ``ProviderError``: retry or park, why, and after how long.

Owns the HTTP status table, ``Retry-After`` parsing and the scrubbing of provider messages. It
knows no SDK: the provider modules hand it a status, headers and a body, and raise what it returns.
"""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

from store import errors, redaction

#: Longest message a provider failure keeps (it is stored on the checkpoint and shown to people).
MAX_MESSAGE_CHARS = 500

#: Statuses worth another try later: request timeout, conflict, and every server-side failure.
_RETRYABLE_4XX = {408: "timeout", 409: "server"}
_PARKING_4XX = {401: "auth", 402: "auth", 403: "auth", 404: "not-found", 413: "context-length"}

# Provider wording for "the transcript does not fit": OpenAI, Anthropic, vLLM, LM Studio, llama.cpp.
_CONTEXT_LENGTH = re.compile(
    r"context[ _-]?(length|window|limit)|maximum context|prompt is too long|input is too long"
    r"|exceeds? the (model'?s? )?(available )?context|too many (input |prompt )?tokens",
    re.IGNORECASE,
)
_CONTEXT_CODES = {"context_length_exceeded", "string_above_max_length", "request_too_large"}
_QUOTA_CODES = {"insufficient_quota", "billing_hard_limit_reached"}
# Error types sent inside a stream (Anthropic's and OpenAI's), by the status the same failure has as an answer.
_STREAM_ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "rate_limit_exceeded": 429,
    "insufficient_quota": 429,
    "context_length_exceeded": 400,
    "api_error": 500,
    "server_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}

_REDACTED = "[redacted]"
# Beyond ``store.redaction``: masked keys providers echo back (sk-proj-****abcd) and key assignments.
_KEY_SHAPES = (
    (re.compile(r"\b(?:sk|rk|pk)-[A-Za-z0-9_\-*.]{6,}"), _REDACTED),
    (re.compile(r"(?i)\b(bearer\s+)[^\s\"',;]+"), r"\1" + _REDACTED),
    (re.compile(r"(?i)\b((?:x-)?api[_-]?key[\"']?\s*[:=]\s*[\"']?)[^\s\"',;}]+"), r"\1" + _REDACTED),
)


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without key material: the given secrets and anything shaped like a key or token."""
    for secret in secrets:
        if secret and len(secret) >= 6:
            text = text.replace(secret, _REDACTED)
    text = redaction.redact(text)
    for pattern, replacement in _KEY_SHAPES:
        text = pattern.sub(replacement, text)
    return text


def _cap(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


def retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds the provider asks us to wait: ``retry-after-ms``, or ``Retry-After`` as seconds or an HTTP date."""
    lowered = {k.lower(): v for k, v in headers.items()}
    millis = lowered.get("retry-after-ms")
    if millis is not None:
        try:
            return max(float(millis) / 1000, 0.0)
        except ValueError:
            pass
    value = lowered.get("retry-after")
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)


def _error_fields(body: object) -> tuple[str, str]:
    """(message, code) from the usual error envelopes: ``{"error": {...}}`` or the inner object."""
    inner: Any = body
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        inner = body["error"]
    if isinstance(inner, Mapping):
        message = inner.get("message") or inner.get("detail") or inner.get("error") or ""
        code = inner.get("code") or inner.get("type") or ""
        if not isinstance(message, str):
            message = str(message)
        return message, str(code)
    if isinstance(body, str | bytes):
        return (body.decode(errors="replace") if isinstance(body, bytes) else body), ""
    return "", ""


def is_context_length(message: str, code: str) -> bool:
    """Whether a refused request failed because the transcript does not fit the model."""
    return code in _CONTEXT_CODES or bool(_CONTEXT_LENGTH.search(message))


def from_status(
    provider: str,
    status: int,
    headers: Mapping[str, str],
    body: object,
    *,
    request_id: str | None = None,
    secrets: Iterable[str] = (),
) -> errors.ProviderError:
    """The error for an HTTP failure: 429 and 5xx retry (after ``Retry-After``), other 4xx park the run."""
    message, code = _error_fields(body)
    return _classify(provider, status, f"HTTP {status}", message, code, retry_after(headers), request_id, secrets)


def from_stream_error(
    provider: str, body: object, *, request_id: str | None = None, secrets: Iterable[str] = ()
) -> errors.ProviderError:
    """The error for an error event inside a stream that had begun with a 200 (``overloaded_error``…).

    The event's error type stands for the status the same failure has as an answer, and is
    classified (and reported as ``status``) like it; a type we do not know is a server failure
    (retryable), since the request itself had been accepted.
    """
    message, code = _error_fields(body)
    status = _STREAM_ERROR_STATUS.get(code, 500)
    where = f"in stream: {scrub(code, secrets)[:40] or 'error'}"
    return _classify(provider, status, where, message, code, None, request_id, secrets)


def _classify(
    provider: str,
    status: int,
    where: str,
    message: str,
    code: str,
    wait: float | None,
    request_id: str | None,
    secrets: Iterable[str],
) -> errors.ProviderError:
    if status == 429 and code not in _QUOTA_CODES:
        return errors.ProviderRateLimitedError(
            _describe(provider, "rate-limit", where, message, request_id, secrets, wait), retry_after=wait
        )
    if status == 429:
        category, retryable = "auth", False  # out of quota: waiting does not help, the account must change
    elif status >= 500 or status in _RETRYABLE_4XX:
        category, retryable = _RETRYABLE_4XX.get(status, "server"), True
    elif is_context_length(message, code):
        category, retryable = "context-length", False
    else:
        category, retryable = _PARKING_4XX.get(status, "invalid-request"), False
    return errors.ProviderError(
        _describe(provider, category, where, message, request_id, secrets, wait),
        retryable=retryable,
        category=category,
        retry_after=wait if retryable else None,
        status=status,
    )


def timed_out(provider: str, seconds: float) -> errors.ProviderError:
    """The error for a request that got no answer within the client timeout (retryable)."""
    return errors.ProviderError(
        f"{provider}: timeout: no answer within {seconds:g} s", retryable=True, category="timeout"
    )


def unreachable(provider: str, detail: str, secrets: Iterable[str] = ()) -> errors.ProviderError:
    """The error for a request that never got an HTTP answer (refused, reset, DNS); retryable."""
    return errors.ProviderError(
        _cap(scrub(f"{provider}: connection: {detail}", secrets)), retryable=True, category="connection"
    )


def cut_off(provider: str, detail: str) -> errors.ProviderError:
    """The error for a stream that ended before the answer was complete (retryable, like a dropped connection)."""
    return errors.ProviderError(_cap(f"{provider}: connection: {detail}"), retryable=True, category="connection")


def unexpected(provider: str, detail: str, secrets: Iterable[str] = ()) -> errors.ProviderError:
    """The error for an answer we cannot read (not the API's shape); retried, then parked by the attempts cap."""
    return errors.ProviderError(
        _cap(scrub(f"{provider}: unknown: {detail}", secrets)), retryable=True, category="unknown"
    )


def _describe(
    provider: str,
    category: str,
    where: str,
    message: str,
    request_id: str | None,
    secrets: Iterable[str],
    wait: float | None,
) -> str:
    head = f"{provider}: {category} ({where})"
    tail = (f" [retry after {round(wait, 1):g} s]" if wait is not None else "") + (
        f" [request {scrub(request_id, secrets)[:80]}]" if request_id else ""
    )
    room = MAX_MESSAGE_CHARS - len(head) - len(tail) - 2
    detail = " ".join(scrub(message, secrets).split())
    if len(detail) > room:
        detail = detail[: room - 1] + "…"
    return f"{head}: {detail}{tail}" if detail else head + tail
