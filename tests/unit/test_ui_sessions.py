"""The run pages' signed cookies: a session lasts its hours and a sign-in form its half hour, then neither reads."""

from __future__ import annotations

import pytest

from producer.http.access import Keys, Principal
from producer.ui import sessions

NOW = 1_900_000_000.0
OPS = Principal("ops", read_only=True, agents=frozenset({"desk"}))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The time the signer reads, settable by the test."""
    now = [NOW]
    monkeypatch.setattr("producer.ui.sessions.time.time", lambda: now[0])
    return now


def _signer() -> sessions.Signer:
    return sessions.Signer(Keys([("ops-key-0123456789abcdef", OPS)]))


def test_a_session_cookie_reads_until_its_hours_are_up_and_never_after(clock: list[float]) -> None:
    signer = _signer()
    value, made = signer.session_cookie(OPS, 2.0)
    assert made.expires_at == NOW + 2 * 3600
    clock[0] = NOW + 2 * 3600 - 1
    read = signer.read_session(value)
    assert read is not None and read.principal == OPS and read.session_id == made.session_id
    assert read.expires_at == made.expires_at
    clock[0] = NOW + 2 * 3600 + 1
    assert signer.read_session(value) is None


def test_a_sign_in_form_is_usable_for_its_half_hour_only(clock: list[float]) -> None:
    signer = _signer()
    cookie, token = signer.login_cookie()
    clock[0] = NOW + sessions.LOGIN_FORM_S - 1
    assert signer.login_token_ok(cookie, token)
    assert not signer.login_token_ok(cookie, token[::-1])
    clock[0] = NOW + sessions.LOGIN_FORM_S + 1
    assert not signer.login_token_ok(cookie, token)
    assert sessions.LOGIN_FORM_S == 1800


def test_a_cookie_of_one_kind_or_of_other_keys_is_not_read_as_another(clock: list[float]) -> None:
    signer = _signer()
    session, _ = signer.session_cookie(OPS, 1.0)
    login, token = signer.login_cookie()
    assert signer.read_session(login) is None and not signer.login_token_ok(session, token)
    rekeyed = sessions.Signer(Keys([("other-key-0123456789abcdef", OPS)]))
    assert rekeyed.read_session(session) is None
