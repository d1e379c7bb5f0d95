"""Request bodies: streamed under a byte cap, then decoded as untrusted JSON.

Owns the 413 refusal (by Content-Length or while the body streams) and the 400 refusal of a body that is not
acceptable JSON; neither message echoes the body. It must not interpret what the JSON means.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import ClientDisconnect, Request

from producer.http import headers
from producer.http.rejections import bad_request, too_large
from store import errors, payloads


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused past ``limit`` bytes by its Content-Length or while it streams.

    Raises:
        Rejected: 413 when too large, 400 for a malformed length or a dropped connection.
    """
    length = headers.one(request.headers, "content-length")
    if length is not None:
        if not length.isdigit():
            raise bad_request("malformed content-length")
        if int(length) > limit:
            raise too_large()
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large()
    except ClientDisconnect:
        raise bad_request("the client went away") from None
    return bytes(body)


def parse_json(body: bytes) -> Any:
    r"""The body as JSON: UTF-8 only (a BOM is ignored), lone surrogates and NULs replaced by U+FFFD.

    ``\ud800`` is valid JSON but cannot be stored; replacing it here keeps the sender from retrying
    a body that could never be accepted.

    Raises:
        Rejected: 400 when the body is not UTF-8 or not acceptable JSON.
    """
    try:
        document = payloads.loads_untrusted(body.decode("utf-8-sig"))
    except (UnicodeDecodeError, errors.InputTooLargeError):
        raise bad_request("the body is not acceptable JSON") from None
    return payloads.sanitize(document)
