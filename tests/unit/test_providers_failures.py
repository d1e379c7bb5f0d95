"""Failure classification without any SDK: status table, Retry-After, context length, scrubbing, caps."""

from __future__ import annotations

import email.utils

import pytest

from store import errors
from worker.providers import _failures

pytestmark = pytest.mark.usefixtures("no_real_providers")

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Retry-After": "7"}, 7.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),
        ({"retry-after": email.utils.formatdate(NOW + 12, usegmt=True)}, 12.0),
        ({"retry-after": email.utils.formatdate(NOW - 30, usegmt=True)}, 0.0),
        ({"retry-after": "-3"}, 0.0),
        ({"retry-after": "soon"}, None),
        ({"retry-after-ms": "x"}, None),
        ({}, None),
    ],
)
def test_retry_after_reads_seconds_milliseconds_and_http_dates(headers: dict[str, str], expected: float | None) -> None:
    assert _failures.retry_after(headers, now=NOW) == expected


@pytest.mark.parametrize(
    ("status", "body", "category", "retryable"),
    [
        (429, {"message": "slow down"}, "rate-limit", True),
        (500, {"message": "oops"}, "server", True),
        (502, "<html>bad gateway</html>", "server", True),
        (503, {}, "server", True),
        (529, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, "server", True),
        (408, {}, "timeout", True),
        (409, {}, "server", True),
        (400, {"message": "messages: field required"}, "invalid-request", False),
        (401, {"message": "bad key"}, "auth", False),
        (402, {}, "auth", False),
        (403, {"message": "not allowed"}, "auth", False),
        (404, {"message": "no such model"}, "not-found", False),
        (413, {"type": "error", "error": {"type": "request_too_large", "message": "too big"}}, "context-length", False),
        (422, {"detail": "bad"}, "invalid-request", False),
        (418, {}, "invalid-request", False),
    ],
)
def test_each_status_class_retries_or_parks(status: int, body: object, category: str, retryable: bool) -> None:
    error = _failures.from_status("openai", status, {}, body)
    assert (error.category, error.retryable, error.status) == (category, retryable, status)


def test_a_429_is_a_rate_limit_error_with_the_servers_wait() -> None:
    error = _failures.from_status("anthropic", 429, {"retry-after": "3"}, {"message": "rate limited"})
    assert isinstance(error, errors.ProviderRateLimitedError)
    assert error.code == "LOUSHO_PROVIDER_RATE_LIMITED" and error.retry_after == 3.0
    assert error.message == "anthropic: rate-limit (HTTP 429): rate limited [retry after 3 s]"


def test_a_5xx_keeps_its_retry_after_and_a_4xx_drops_it() -> None:
    assert _failures.from_status("openai", 503, {"retry-after": "4"}, {}).retry_after == 4.0
    assert _failures.from_status("openai", 400, {"retry-after": "4"}, {}).retry_after is None


def test_an_exhausted_quota_parks_instead_of_waiting() -> None:
    body = {"message": "You exceeded your current quota", "code": "insufficient_quota"}
    error = _failures.from_status("openai", 429, {}, body)
    assert not isinstance(error, errors.ProviderRateLimitedError)
    assert (error.retryable, error.category) == (False, "auth")


@pytest.mark.parametrize(
    "body",
    [
        {
            "message": "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens",
            "code": "context_length_exceeded",
        },
        {"message": "whatever", "code": "context_length_exceeded"},
        {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long: 210000 > 200000"}},
        {"message": "input length and `max_tokens` exceed context limit: 190000 + 20000 > 200000"},
        {"object": "error", "message": "This model's maximum context length is 4096 tokens.", "code": 400},
        {"error": "the request exceeds the available context size, try increasing it"},
    ],
)
def test_context_length_errors_park_with_their_own_category(body: object) -> None:
    error = _failures.from_status("openai", 400, {}, body)
    assert (error.category, error.retryable) == ("context-length", False)


def test_other_bad_requests_are_not_mistaken_for_context_length() -> None:
    error = _failures.from_status("openai", 400, {}, {"message": "max_tokens is too large: 100000"})
    assert error.category == "invalid-request"


def test_messages_never_carry_key_material() -> None:
    key = "sk-proj-AbCdEf0123456789xyz"
    body = {"message": f"Incorrect API key provided: {key}. Header was 'Authorization: Bearer {key}', api_key={key}"}
    error = _failures.from_status("openai", 401, {}, body, secrets=[key], request_id="req_1")
    assert key not in error.message and "AbCdEf" not in error.message
    assert "[redacted]" in error.message and error.message.endswith("[request req_1]")


@pytest.mark.parametrize(
    "text",
    [
        "key sk-ant-api03-abcdefghijkl was refused",
        "Bearer abc.def.ghi",
        "x-api-key: 12345678abcdef",
        "api_key='hunter22hunter'",
        "masked sk-proj-****************wxyz",
    ],
)
def test_scrub_removes_key_shaped_text(text: str) -> None:
    scrubbed = _failures.scrub(text)
    for secret in ("abcdefghijkl", "abc.def.ghi", "12345678abcdef", "hunter22hunter", "wxyz"):
        assert secret not in scrubbed


def test_messages_are_capped_and_keep_the_request_id() -> None:
    error = _failures.from_status("openai", 500, {"retry-after": "1"}, {"message": "x" * 5000}, request_id="req_9")
    assert len(error.message) <= _failures.MAX_MESSAGE_CHARS
    assert error.message.endswith("[retry after 1 s] [request req_9]")


def test_transport_failures_are_retryable() -> None:
    assert (_failures.timed_out("openai", 0.5).category, _failures.timed_out("openai", 0.5).retryable) == (
        "timeout",
        True,
    )
    refused = _failures.unreachable("anthropic", "ConnectError: [Errno 111] Connection refused")
    assert (refused.category, refused.retryable) == ("connection", True)
    assert _failures.unexpected("openai", "token s3cr3t-v4lue", ["s3cr3t-v4lue"]).message == (
        "openai: unknown: token [redacted]"
    )
