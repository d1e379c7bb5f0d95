"""Secret-shaped values never reach a log line."""

from __future__ import annotations

import logging

import pytest

from store import redaction

SECRETS = [
    "sk-proj-abcdefghijklmnop1234", "sk-ant-api03-abcdefghijkl", "Bearer abcdefghijklmnop.qrs",
    "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "postgresql://lousho:s3cretpass@db:5432/lousho",
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
