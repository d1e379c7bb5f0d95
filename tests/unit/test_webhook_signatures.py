"""The pure signature functions of the webhook receiver: HMACs, key rotation, the timestamp window."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable
from functools import partial

import pytest

from producer.http import signatures
from producer.http.rejections import Rejected

KEY = b"unit-key-0123456789abcdef"
OTHER = b"other-key-0123456789abcde"
BODY = b'{"event":"order.paid"}'


def _refused(call: Callable[[], None]) -> tuple[int, str]:
    with pytest.raises(Rejected) as caught:
        call()
    return caught.value.status, caught.value.code


def test_sign_is_the_v1_hmac_of_id_timestamp_and_body() -> None:
    digest = hmac.new(KEY, b"msg_1.1700000000." + BODY, hashlib.sha256).digest()
    assert signatures.sign(KEY, "msg_1", 1700000000, BODY) == "v1," + base64.b64encode(digest).decode()


def test_a_signature_verifies_under_its_key_and_any_rotation_that_holds_it() -> None:
    signature = signatures.sign(KEY, "msg_1", 1700000000, BODY)
    signatures.verify_standard((KEY,), "msg_1", 1700000000, BODY, [signature])
    signatures.verify_standard((OTHER, KEY), "msg_1", 1700000000, BODY, [signature])
    assert _refused(lambda: signatures.verify_standard((OTHER,), "msg_1", 1700000000, BODY, [signature])) == (
        401,
        "LOUSHO_WEBHOOK_SIGNATURE_INVALID",
    )


def test_no_key_verifies_nothing() -> None:
    signature = signatures.sign(KEY, "msg_1", 1700000000, BODY)
    assert _refused(lambda: signatures.verify_standard((), "msg_1", 1700000000, BODY, [signature]))[0] == 401


def test_malformed_and_other_version_signatures_are_skipped_not_fatal() -> None:
    good = signatures.sign(KEY, "msg_1", 1700000000, BODY)
    signatures.verify_standard((KEY,), "msg_1", 1700000000, BODY, ["v1,not base64!", "v2," + good[3:], "junk", good])
    assert (
        _refused(
            lambda: signatures.verify_standard((KEY,), "msg_1", 1700000000, BODY, ["v1,not base64!", "v2," + good[3:]])
        )[0]
        == 401
    )


def test_the_timestamp_window_holds_up_to_the_tolerance_either_way() -> None:
    now = 1_700_000_000.0
    signatures.check_timestamp(int(now) - signatures.TOLERANCE_S, now)
    signatures.check_timestamp(int(now) + signatures.TOLERANCE_S, now)
    for stamp in (int(now) - signatures.TOLERANCE_S - 1, int(now) + signatures.TOLERANCE_S + 1):
        assert _refused(partial(signatures.check_timestamp, stamp, now)) == (401, "LOUSHO_WEBHOOK_TIMESTAMP_INVALID")
    signatures.check_timestamp(int(now) - 50, now, tolerance_s=60)
    assert _refused(lambda: signatures.check_timestamp(int(now) - 61, now, tolerance_s=60))[0] == 401


def test_a_github_signature_is_the_sha256_hmac_of_the_body_under_any_key() -> None:
    good = "sha256=" + hmac.new(KEY, BODY, hashlib.sha256).hexdigest()
    signatures.verify_github((OTHER, KEY), good, BODY)
    for bad in ("sha1=" + good[7:], "sha256=" + good[7:-2], "sha256=zz", "sha256", ""):
        assert _refused(partial(signatures.verify_github, (KEY,), bad, BODY))[0] == 401
    assert _refused(lambda: signatures.verify_github((KEY,), good, BODY + b" "))[0] == 401
    assert _refused(lambda: signatures.verify_github((), good, BODY))[0] == 401
