"""Signature checks: Standard Webhooks and GitHub HMACs, the timestamp window, constant-time comparison.

Pure functions of keys, ids and bytes: no HTTP framework, no I/O, no clock (``now`` is an argument).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from producer.http.rejections import Rejected, unsigned

#: How far a signed ``webhook-timestamp`` may be from now, in seconds (the replay window).
TOLERANCE_S = 300


def _signed_content(delivery_id: str, timestamp: int | str, body: bytes) -> bytes:
    return f"{delivery_id}.{timestamp}.".encode() + body


def sign(key: bytes, delivery_id: str, timestamp: int | str, body: bytes) -> str:
    """The Standard Webhooks ``webhook-signature`` value for ``body`` (``v1,<base64>``)."""
    digest = hmac.new(key, _signed_content(delivery_id, timestamp, body), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def check_timestamp(timestamp: int, now: float, tolerance_s: int = TOLERANCE_S) -> None:
    """Refuse a signed timestamp further than ``tolerance_s`` from ``now`` (replay window).

    Raises:
        Rejected: 401 when it is too old or too far in the future.
    """
    if abs(now - timestamp) > tolerance_s:
        raise Rejected(401, "LOUSHO_WEBHOOK_TIMESTAMP_INVALID", "webhook-timestamp outside the accepted window")


def _v1_digests(signatures: list[str]) -> list[bytes]:
    """The decoded ``v1`` signatures; other versions and malformed base64 are skipped, not refused."""
    provided = []
    for item in signatures:
        version, _, encoded = item.partition(",")
        if version != "v1":
            continue
        try:
            provided.append(base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            continue
    return provided


def verify_standard(
    keys: tuple[bytes, ...], delivery_id: str, timestamp: int, body: bytes, signatures: list[str]
) -> None:
    """Accept when any ``v1`` signature matches any key (rotation) over ``id.timestamp.body``.

    Raises:
        Rejected: 401 when none matches.
    """
    provided = _v1_digests(signatures)
    signed = _signed_content(delivery_id, timestamp, body)
    for key in keys:
        expected = hmac.new(key, signed, hashlib.sha256).digest()
        if any(hmac.compare_digest(expected, candidate) for candidate in provided):
            return
    raise unsigned()


def verify_github(keys: tuple[bytes, ...], signature: str, body: bytes) -> None:
    """Accept GitHub's ``X-Hub-Signature-256: sha256=<hex>`` (HMAC of the body) under any key.

    Raises:
        Rejected: 401 when it does not match.
    """
    scheme, _, hexdigest = signature.partition("=")
    try:
        provided = bytes.fromhex(hexdigest)
    except ValueError:
        raise unsigned() from None
    if scheme == "sha256":
        for key in keys:
            if hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(), provided):
                return
    raise unsigned()
