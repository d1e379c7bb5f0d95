"""Reading the request headers the receiver relies on: signature headers, delivery ids, the content type.

Owns the 400/415 refusals of missing, repeated or malformed headers; it verifies no signature itself.
"""

from __future__ import annotations

import re

from starlette.datastructures import Headers

from producer.http.rejections import Rejected, bad_request
from store import errors
from store.deliveries import check_delivery_id

#: At most this many signatures of one ``webhook-signature`` header are tried.
_MAX_SIGNATURES = 16
_TIMESTAMP = re.compile(r"[0-9]{1,12}")


def one(headers: Headers, name: str) -> str | None:
    """The single value of header ``name``, or None when absent.

    Raises:
        Rejected: 400 when the header is repeated.
    """
    values = headers.getlist(name)
    if len(values) > 1:
        raise bad_request(f"duplicate {name} header")
    return values[0] if values else None


def _delivery_id(value: str, header: str) -> str:
    try:
        check_delivery_id(value)
    except errors.ConfigurationError:
        raise bad_request(f"{header} must be 1-256 printable ASCII characters") from None
    return value


def standard_headers(headers: Headers) -> tuple[str, int, list[str]]:
    """``(webhook-id, webhook-timestamp, signatures)`` of a Standard Webhooks request.

    Raises:
        Rejected: 400 when a header is missing, repeated or malformed.
    """
    delivery_id, stamp, signature = (one(headers, n) for n in ("webhook-id", "webhook-timestamp", "webhook-signature"))
    if delivery_id is None or stamp is None or signature is None:
        raise bad_request("webhook-id, webhook-timestamp and webhook-signature are required")
    _delivery_id(delivery_id, "webhook-id")
    if not _TIMESTAMP.fullmatch(stamp):
        raise bad_request("webhook-timestamp must be integer seconds")
    return delivery_id, int(stamp), signature.split()[:_MAX_SIGNATURES]


def github_headers(headers: Headers) -> tuple[str, str]:
    """``(X-GitHub-Delivery, X-Hub-Signature-256)`` of a GitHub request.

    Raises:
        Rejected: 400 when a header is missing, repeated or malformed.
    """
    signature, github_id = one(headers, "x-hub-signature-256"), one(headers, "x-github-delivery")
    if signature is None or github_id is None:
        raise bad_request("X-Hub-Signature-256 and X-GitHub-Delivery are required")
    return _delivery_id(github_id, "X-GitHub-Delivery"), signature


def check_json_type(headers: Headers) -> None:
    """Refuse a body that is not declared ``application/json``.

    Raises:
        Rejected: 415 for any other media type, 400 for a repeated Content-Type.
    """
    media = (one(headers, "content-type") or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise Rejected(415, "LOUSHO_WEBHOOK_CONTENT_TYPE", "the body must be application/json")
