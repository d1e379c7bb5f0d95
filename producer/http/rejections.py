"""``Rejected``, the one way the receiver refuses a request, and the refusals several modules share.

Owns the status, stable code and generic message of a refusal; it must never echo the request.
"""

from __future__ import annotations


class Rejected(Exception):
    """A request refused with ``status``; ``message`` is generic and never echoes the request."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def bad_request(message: str) -> Rejected:
    """A 400 refusal: a header or body the receiver cannot read."""
    return Rejected(400, "LOUSHO_WEBHOOK_BAD_REQUEST", message)


def unsigned() -> Rejected:
    """A 401 refusal: no signature matched (which key or signature failed is never said)."""
    return Rejected(401, "LOUSHO_WEBHOOK_SIGNATURE_INVALID", "signature verification failed")


def too_large() -> Rejected:
    """A 413 refusal: the body is over the size limit."""
    return Rejected(413, "LOUSHO_WEBHOOK_TOO_LARGE", "the body is over the size limit")
