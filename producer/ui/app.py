"""The run pages' plumbing: whether they are on, who is signed in, CSRF and origin checks, forms, rendering.

``producer.ui.routes.mount`` adds the pages to the HTTP server; every page goes through ``signed_in`` or ``acting``
here. It never logs a key, a form or a run's content.
"""

from __future__ import annotations

import hmac
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from producer.http import bodies
from producer.http.access import Principal
from producer.http.backend import Backend
from producer.http.config import WebhookConfig
from producer.http.rejections import Rejected
from producer.ui import drawing, sessions
from store.settings import Settings

_HERE = Path(__file__).parent
STATIC_DIR = _HERE / "static"
_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(_HERE / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_ENV.filters["took"] = lambda ms: drawing.duration_text(float(ms) / 1000)
#: Headers of every page: nothing loads from elsewhere, nothing inline runs, nothing is cached or framed.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
#: Largest form body accepted (a fork's patch is the biggest field).
MAX_FORM_BYTES = 256 * 1024
CSRF_REFUSED = "CSRF token missing or invalid"
_NEXT = re.compile(r"/ui/[A-Za-z0-9/_.~:@%+=&?-]*")
_DEFAULT_SETTINGS = Settings.model_construct()


class PageError(Exception):
    """A page refused with ``status`` and a short message shown to the person (never echoing their input)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Viewer:
    """The signed-in person on this request and the CSRF token of the forms shown to them."""

    principal: Principal
    csrf_token: str
    #: Signed in by the proxy header (no session cookie, no sign-out).
    by_proxy: bool = False


def settings_of(request: Request) -> Settings:
    """The server's settings (the defaults when the app was built without any)."""
    settings: Settings | None = request.app.state.settings
    return settings if settings is not None else _DEFAULT_SETTINGS


def config_of(request: Request) -> WebhookConfig:
    """The server's configuration, built at startup."""
    config: WebhookConfig = request.app.state.config
    return config


def backend_of(request: Request) -> Backend:
    """The server's stores and client."""
    backend: Backend = request.app.state.backend
    return backend


def check_enabled(request: Request) -> None:
    """Answer 404 for every page unless the pages are on and some API key is set.

    Raises:
        HTTPException: 404, as for a path that does not exist.
    """
    config: WebhookConfig | None = request.app.state.config
    if config is None or not settings_of(request).ui_enabled or not config.keys:
        raise HTTPException(404)


def signer_of(request: Request) -> sessions.Signer:
    """The signer of this server's sessions (keyed by the session secret and the API keys)."""
    secret = settings_of(request).ui_session_secret
    return sessions.Signer(config_of(request).keys, secret.get_secret_value() if secret is not None else None)


def viewer(request: Request) -> Viewer | None:
    """Who is signed in: the proxy's user when its header is configured and present, else the session cookie."""
    settings, signer = settings_of(request), signer_of(request)
    if settings.ui_proxy_user_header and _from_proxy(request, settings.ui_proxy_addresses):
        user = request.headers.get(settings.ui_proxy_user_header)
        if user:
            principal = sessions.proxy_principal(user, settings.ui_proxy_access)
            if principal is not None:
                return Viewer(principal, signer.csrf_token(sessions.proxy_session_id(principal.name)), by_proxy=True)
    session = signer.read_session(request.cookies.get(sessions.SESSION_COOKIE))
    if session is None:
        return None
    return Viewer(session.principal, signer.csrf_token(session.session_id))


def _from_proxy(request: Request, addresses: str) -> bool:
    """Whether the request came straight from the authenticating proxy (``LOUSHO_UI_PROXY_ADDRESSES``).

    Anyone who reaches the server past the proxy could set its header: it counts only from those addresses.
    """
    peer = request.client.host if request.client is not None else None
    return peer is not None and peer in {a.strip() for a in addresses.split(",") if a.strip()}


def safe_next(value: str | None, default: str = "/ui/runs") -> str:
    """``value`` when it is a path of these pages, else ``default`` (never another site)."""
    if value and _NEXT.fullmatch(value) and "//" not in value and ".." not in value:
        return value
    return default


def signed_in(request: Request) -> Viewer:
    """The viewer of a page (GET).

    Raises:
        HTTPException: 404 when the pages are off.
        _SignIn: no valid session: the person is sent to the sign-in page, back here after.
    """
    check_enabled(request)
    found = viewer(request)
    if found is None:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise _SignIn(safe_next(target))
    return found


def check_origin(request: Request) -> None:
    """Refuse a POST sent from a page of another site (its ``Origin`` is not this server).

    Raises:
        PageError: 403.
    """
    origin = request.headers.get("origin")
    if origin is None:
        return
    parts = urllib.parse.urlsplit(origin)
    host = request.headers.get("host", "")
    default_port = {"http": ":80", "https": ":443"}.get(parts.scheme, "")
    if (
        origin == "null"
        or not parts.netloc
        or (
            parts.netloc != host
            and parts.netloc + default_port != host
            and parts.netloc != host.removesuffix(default_port)
        )
    ):
        raise PageError(403, "This request came from another site and was refused")


async def read_form(request: Request) -> dict[str, str]:
    """The url-encoded form of a POST (first value of each field), at most ``MAX_FORM_BYTES``.

    Raises:
        PageError: 413 when too large, 400 when unreadable.
    """
    try:
        body = await bodies.read_body(request, MAX_FORM_BYTES)
    except Rejected as exc:
        raise PageError(
            exc.status, "The form is too large" if exc.status == 413 else "The form could not be read"
        ) from None
    try:
        fields = urllib.parse.parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=50)
    except (UnicodeDecodeError, ValueError):
        raise PageError(400, "The form could not be read") from None
    return {name: values[0] for name, values in fields.items()}


async def acting(request: Request, *, read_ok: bool = False) -> tuple[Viewer, dict[str, str]]:
    """The viewer and form of a POST: signed in, same origin, carrying their CSRF token, allowed to act.

    Raises:
        HTTPException: 404 when the pages are off.
        PageError: 401 without a session, 403 from another origin, without the CSRF token or for a read-only key.
    """
    check_enabled(request)
    found = viewer(request)
    if found is None:
        raise PageError(401, "Sign in first")
    check_origin(request)
    form = await read_form(request)
    token = form.get("csrf_token") or ""
    if not hmac.compare_digest(token.encode(), found.csrf_token.encode()):
        raise PageError(403, CSRF_REFUSED)
    if found.principal.read_only and not read_ok:
        raise PageError(403, "This key may read runs, not act on them")
    return found, form


def not_found(what: str = "run") -> NoReturn:
    """Answer a run (or approval) that does not exist or is not visible to this key.

    Raises:
        PageError: 404.
    """
    raise PageError(404, f"No such {what}")


def render(name: str, request: Request, found: Viewer | None, status_code: int = 200, **context: Any) -> HTMLResponse:
    """The page ``name`` with the common context (who is signed in, their CSRF token, the Flower address)."""
    html = _ENV.get_template(name).render(
        viewer=found,
        csrf_token=found.csrf_token if found else "",
        flower_url=settings_of(request).flower_url,
        **context,
    )
    return HTMLResponse(html, status_code=status_code, headers=PAGE_HEADERS)


def render_fragment(name: str, request: Request, found: Viewer, **context: Any) -> str:
    """A part of a page (what the live endpoint sends)."""
    return _ENV.get_template(name).render(
        viewer=found, csrf_token=found.csrf_token, flower_url=settings_of(request).flower_url, **context
    )


def redirect(path: str) -> RedirectResponse:
    """A 303 to one of the pages (after a POST)."""
    return RedirectResponse(path, status_code=303, headers={"Cache-Control": "no-store"})


class _SignIn(Exception):
    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


async def _on_sign_in(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, _SignIn)  # registered for _SignIn only
    return redirect("/ui/login?" + urllib.parse.urlencode({"next": exc.next_path}))


async def _on_page_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PageError)  # registered for PageError only
    found = viewer(request) if request.app.state.config is not None else None
    return render("error.html", request, found, status_code=exc.status, message=exc.message)


def add_handlers(app: FastAPI) -> None:
    """Answer ``PageError`` with an error page and a page without a session with the sign-in redirect."""
    app.add_exception_handler(PageError, _on_page_error)
    app.add_exception_handler(_SignIn, _on_sign_in)


__all__ = [
    "CSRF_REFUSED",
    "MAX_FORM_BYTES",
    "PAGE_HEADERS",
    "PageError",
    "Viewer",
    "acting",
    "add_handlers",
    "backend_of",
    "check_enabled",
    "config_of",
    "not_found",
    "redirect",
    "render",
    "render_fragment",
    "safe_next",
    "settings_of",
    "signed_in",
    "signer_of",
    "viewer",
]
