"""Secret-shaped values never reach a log line."""

from __future__ import annotations

import io
import logging
import sys
import threading
from collections.abc import Iterator

import pytest

from store import redaction

SECRETS = [
    "sk-proj-abcdefghijklmnop1234",
    "sk-ant-api03-abcdefghijkl",
    "Bearer abcdefghijklmnop.qrs",
    "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
    "postgresql://lousho:s3cretpass@db:5432/lousho",
    "redis://:hunter2hunter2@cache:6379/0",
]


@pytest.mark.parametrize("secret", SECRETS)
def test_secret_shaped_text_is_masked(secret: str) -> None:
    masked = redaction.redact(f"failed with {secret} inside")
    assert "***" in masked
    for part in ("abcdefghijklmnop", "MfKQ9r8GKYqrTwjUPD8I", "s3cretpass", "hunter2hunter2", "abcdefghijkl"):
        assert part not in masked


def test_the_filter_masks_messages_arguments_and_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("lousho.test.redaction")
    logger.addFilter(redaction.RedactingFilter())
    with caplog.at_level(logging.INFO, logger="lousho.test.redaction"):
        logger.info("calling with key %s", "sk-live-0123456789abcdef")
        try:
            raise RuntimeError("dsn postgresql://u:topsecret1@h/db")
        except RuntimeError:
            logger.exception("boom")
    text = caplog.text
    assert "0123456789abcdef" not in text and "topsecret1" not in text
    assert text.count("***") >= 2


def test_plain_text_is_left_alone() -> None:
    assert redaction.redact("run order-7 finished in 3 steps") == "run order-7 finished in 3 steps"


MORE_SECRETS = [
    ("https://api.example.com/v1?api_key=AKx9y8z7w6v5u4&n=1", "AKx9y8z7w6v5u4"),
    ("GET /login?user=ann&password=Hunter2-Pass-0000 HTTP/1.1", "Hunter2-Pass-0000"),
    ("/runs/x?access_token=tok_abcdef123456", "tok_abcdef123456"),
    ("client_secret=cs-0a1b2c3d4e5f", "cs-0a1b2c3d4e5f"),
    ('{"api_key": "AKx9y8z7w6v5u4", "model": "m"}', "AKx9y8z7w6v5u4"),
    ("x-api-key: AKx9y8z7w6v5u4", "AKx9y8z7w6v5u4"),
    ("FLOWER_BASIC_AUTH=admin:flower-pass-123", "flower-pass-123"),
    ("LOUSHO_GITHUB_WEBHOOK_SECRETS=gh-raw-secret-42", "gh-raw-secret-42"),
    ("mysql://app:My-Sql-Pass-9@db:3306/app", "My-Sql-Pass-9"),
    ("https://deploy:Https-Pass-8@git.example.com/repo.git", "Https-Pass-8"),
    ("token ghp_0123456789abcdefghijABCDEFGHIJ012345", "0123456789abcdefghij"),
    ("Authorization: Basic YWRtaW46c2VjcmV0cGFzcw==", "YWRtaW46c2VjcmV0cGFzcw"),
]


@pytest.mark.parametrize(("text", "secret"), MORE_SECRETS)
def test_key_value_pairs_query_parameters_and_url_credentials_are_masked(text: str, secret: str) -> None:
    masked = redaction.redact(text)
    assert secret not in masked and "***" in masked, masked


@pytest.mark.parametrize(
    "text",
    [
        "max_tokens=1000 tokens=5",
        "password reset requested for ann",
        "cwd=/tmp/work",
        "basic configuration loaded",
        "http://127.0.0.1:8000/runs/job-hooks-1",
        "redis://redis:6379/0",
        "the model asked for 3 tokens",
    ],
)
def test_text_that_only_looks_near_a_secret_is_left_alone(text: str) -> None:
    assert redaction.redact(text) == text


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``install()`` for this test only: the record factory and the excepthook are put back after it."""
    factory = logging.getLogRecordFactory()
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    redaction.install(logging.getLogger("lousho.test.installed"))
    yield
    logging.setLogRecordFactory(factory)


def test_install_masks_records_for_handlers_configured_later(installed: None) -> None:
    # A handler added after install() (uvicorn's dictConfig, basicConfig) has no filter of ours.
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("lousho.test.later")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("key %s", "sk-proj-abcdefghijklmnop1234")
        logger.warning("dsn postgresql://u:topsecret1@h/db in the text")
        try:
            raise RuntimeError("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
        except RuntimeError:
            logger.exception("boom")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "abcdefghijklmnop" not in text and "topsecret1" not in text and "MfKQ9r8GKYqrTwjU" not in text
    assert text.count("***") >= 3


def test_arguments_keep_their_shape_for_formatters_that_unpack_them(installed: None) -> None:
    record = logging.getLogger("uvicorn.access").makeRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", "/runs/x?api_key=AKx9y8z7w6v5u4", "1.1", 200),
        None,
    )
    assert isinstance(record.args, tuple) and len(record.args) == 5 and record.args[4] == 200
    assert "AKx9y8z7w6v5u4" not in record.getMessage()


def test_a_message_whose_arguments_do_not_fit_is_masked_not_raised(installed: None) -> None:
    record = logging.getLogger("lousho.test.bad").makeRecord(
        "lousho.test.bad",
        logging.WARNING,
        __file__,
        1,
        "only %s and %s with sk-proj-abcdefghijklmnop1234",
        ("one",),
        None,
    )
    assert "abcdefghijklmnop" not in record.getMessage()


def test_install_masks_uncaught_exceptions(installed: None, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        raise RuntimeError("could not connect to redis://:hunter2hunter2@cache:6379/0")
    except RuntimeError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    err = capsys.readouterr().err
    assert "RuntimeError" in err and "hunter2hunter2" not in err and "***" in err
