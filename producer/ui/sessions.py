"""Who is signed in to the run pages: the signed session cookie, the sign-in form's cookie, CSRF tokens, the proxy.

Owns the cookie format (HMAC-SHA256 over a JSON payload, stdlib only) and the CSRF tokens bound to a session; it
never stores or logs a key: a session holds the principal's name, scope and expiry, never what was presented.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from producer.http import access
from producer.http.access import Keys, Principal

#: The session cookie; the pages live under ``COOKIE_PATH``.
SESSION_COOKIE = "lousho_session"
#: The short-lived cookie that binds the sign-in form's CSRF token before there is a session.
LOGIN_COOKIE = "lousho_login"
COOKIE_PATH = "/ui"
#: Seconds a sign-in form stays usable.
LOGIN_FORM_S = 1800
_MAX_COOKIE_CHARS = 4096


@dataclass(frozen=True)
class Session:
    """A signed-in person: their principal and the id their CSRF tokens are bound to."""

    principal: Principal
    session_id: str
    expires_at: float


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Signer:
    """Signs and checks the pages' cookies and CSRF tokens with one key.

    The key is derived from the API keys' fingerprint (and ``secret`` when set), so adding, changing or removing
    a key ends every session.
    """

    def __init__(self, keys: Keys, secret: str | None = None) -> None:
        base = (secret or "lousho-ui-sessions").encode()
        self._key = hmac.digest(base, b"lousho-ui\0" + keys.fingerprint(), "sha256")

    def _mac(self, purpose: str, payload: str) -> str:
        return _b64(hmac.digest(self._key, f"{purpose}\0{payload}".encode(), "sha256"))

    def _seal(self, purpose: str, body: dict[str, Any]) -> str:
        payload = _b64(json.dumps(body, separators=(",", ":"), sort_keys=True).encode())
        return f"{payload}.{self._mac(purpose, payload)}"

    def _open(self, purpose: str, value: str | None) -> dict[str, Any] | None:
        if not value or len(value) > _MAX_COOKIE_CHARS or value.count(".") != 1:
            return None
        payload, mac = value.split(".")
        if not hmac.compare_digest(mac.encode(), self._mac(purpose, payload).encode()):
            return None
        try:
            body = json.loads(_unb64(payload))
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(body, dict) or not isinstance(body.get("exp"), (int, float)) or body["exp"] < time.time():
            return None
        return body

    def session_cookie(self, principal: Principal, hours: float) -> tuple[str, Session]:
        """A new session of ``principal`` lasting ``hours``: the cookie value and the session."""
        session = Session(principal, secrets.token_urlsafe(18), time.time() + hours * 3600)
        agents = sorted(principal.agents) if principal.agents is not None else None
        body = {
            "n": principal.name,
            "r": principal.read_only,
            "a": agents,
            "sid": session.session_id,
            "exp": session.expires_at,
        }
        return self._seal("session", body), session

    def read_session(self, value: str | None) -> Session | None:
        """The session of a cookie value; None when it is missing, forged, malformed or expired."""
        body = self._open("session", value)
        if body is None:
            return None
        name, read_only, agents, sid = body.get("n"), body.get("r"), body.get("a"), body.get("sid")
        if not isinstance(name, str) or not isinstance(read_only, bool) or not isinstance(sid, str):
            return None
        if agents is not None and not (isinstance(agents, list) and all(isinstance(a, str) for a in agents)):
            return None
        principal = Principal(name, read_only, frozenset(agents) if agents is not None else None)
        return Session(principal, sid, float(body["exp"]))

    def login_cookie(self) -> tuple[str, str]:
        """A sign-in form's cookie value and the CSRF token the form carries."""
        nonce = secrets.token_urlsafe(18)
        return self._seal("login", {"nonce": nonce, "exp": time.time() + LOGIN_FORM_S}), self.csrf_token(
            "login:" + nonce
        )

    def login_token_ok(self, cookie: str | None, token: str | None) -> bool:
        """Whether ``token`` is the CSRF token of the sign-in form whose cookie is ``cookie``."""
        body = self._open("login", cookie)
        return (
            body is not None and isinstance(body.get("nonce"), str) and self.token_ok("login:" + body["nonce"], token)
        )

    def csrf_token(self, bound_to: str) -> str:
        """The CSRF token of forms shown to the session (or sign-in form) ``bound_to``."""
        return self._mac("csrf", bound_to)

    def token_ok(self, bound_to: str, token: str | None) -> bool:
        """Whether ``token`` is the CSRF token bound to ``bound_to`` (compared in constant time)."""
        return bool(token) and hmac.compare_digest(str(token).encode(), self.csrf_token(bound_to).encode())


def proxy_principal(user: str, access_text: str) -> Principal | None:
    """The principal of a person a trusted proxy signed in as ``user``, with ``access_text`` as their access.

    ``access_text`` is a key's options: ``""`` (full), ``read``, ``agents=a|b`` or ``read;agents=a|b``. None for
    an empty or overlong user, or options that do not parse (nobody is signed in then).
    """
    user = user.strip()
    if not user or len(user) > 200 or not user.isprintable():
        return None
    try:
        read_only, agents = access.parse_access(access_text.split(";"))
    except ValueError:
        return None
    return Principal(user, read_only, agents)


def proxy_session_id(user: str) -> str:
    """What the CSRF tokens of a proxy-signed-in person are bound to (they have no session cookie)."""
    return "proxy:" + hashlib.sha256(user.encode()).hexdigest()


__all__ = ["COOKIE_PATH", "LOGIN_COOKIE", "SESSION_COOKIE", "Session", "Signer", "proxy_principal", "proxy_session_id"]
