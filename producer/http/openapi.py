"""``GET /openapi.json``: the OpenAPI 3 document of the receiver's JSON routes (the run pages are left out).

Owns the one error body every 4xx and 503 answers with (``ErrorBody``), the responses each kind of route declares,
and the bearer-key security scheme. FastAPI builds the paths from the routes; this adds what it cannot know.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

#: The security scheme of the routes that take an API key (``Authorization: Bearer <key>``).
BEARER = "bearerKey"


class ErrorDetail(BaseModel):
    """What went wrong: a stable ``LOUSHO_*`` code and a generic message that never echoes the request."""

    model_config = ConfigDict(extra="forbid")

    code: str
    message: str


class ErrorBody(BaseModel):
    """The body of every 4xx (and 503) answer of the JSON routes."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


_MEANINGS = {
    400: "the request is malformed (a query, header or body the server cannot read)",
    401: "no valid API key (or, on intake, no valid signature)",
    403: "the key may read runs, not act on them",
    404: "no such run, approval or agent (or one the key does not see)",
    409: "the run cannot take this now (it waits on an approval, or the approval's run no longer waits on it)",
    410: "the approval expired undecided and was recorded as rejected",
    413: "the body is over the size limit",
    503: "Postgres, Redis or the broker is unavailable; retry later",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route that can answer ``statuses``, each with the one error body."""
    return {status: {"model": ErrorBody, "description": _MEANINGS[status]} for status in statuses}


def keyed() -> dict[str, Any]:
    """``openapi_extra`` of a route that takes an API key."""
    return {"security": [{BEARER: []}]}


def install(app: FastAPI) -> None:
    """Serve the document at ``/openapi.json``, with the bearer scheme, built once on first request."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema.setdefault("components", {}).setdefault("securitySchemes", {})[BEARER] = {
                "type": "http",
                "scheme": "bearer",
                "description": "an API key of LOUSHO_API_KEY or LOUSHO_API_KEYS (a scoped key sees its agents only)",
            }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]  # FastAPI's documented way to extend the document


__all__ = ["BEARER", "ErrorBody", "ErrorDetail", "errors", "install", "keyed"]
