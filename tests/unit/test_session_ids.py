"""Run ids are checked against the spec's rules before they reach a Redis key or a row."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from store import errors
from store.records import validate_session_id

#: The spec's rules, written out independently of the product's implementation.
_SPEC_CHARS = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
_SPEC_RESERVED = re.compile(r"\.(turn-[0-9]+|paused|fire)\Z")


def _spec_allows(session_id: str) -> bool:
    return (
        _SPEC_CHARS.fullmatch(session_id) is not None
        and session_id[0] != "."
        and session_id[-1] != "."
        and _SPEC_RESERVED.search(session_id) is None
    )


@pytest.mark.parametrize(
    "session_id",
    [
        "order-7",
        "a",
        "A_b-c.d",
        "x" * 200,
        "job-3f2a9c",
        "chat.turn-",
        "chat.turn-3x",
        "v1.2.3",
        "paused",
        "a.fired",
    ],
)
def test_valid_ids_are_returned_unchanged(session_id: str) -> None:
    assert validate_session_id(session_id) == session_id


@pytest.mark.parametrize(
    "session_id",
    [
        "",
        "x" * 201,
        ".leading",
        "trailing.",
        ".",
        "chat.turn-3",
        "chat.turn-12",
        "run.paused",
        "sched.fire",
        "caf\u00e9",
        "\u0661\u0662",
        "run\U0001f680",
        "'; DROP TABLE runs; --",
        "has space",
        " padded",
        "tab\there",
        "new\nline",
        "pct%",
        "slash/x",
        "colon:x",
        "star*",
        "nul\x00",
    ],
)
def test_invalid_ids_are_refused_with_a_typed_error(session_id: str) -> None:
    with pytest.raises(errors.SessionIdInvalidError) as raised:
        validate_session_id(session_id)
    assert raised.value.code == "LOUSHO_SESSION_ID_INVALID" and raised.value.retryable is False


@pytest.mark.parametrize("session_id", [None, 7, b"order-7", ["order-7"]])
def test_ids_that_are_not_strings_are_refused(session_id: object) -> None:
    with pytest.raises(errors.SessionIdInvalidError):
        validate_session_id(session_id)


_ID_ALPHABET = st.sampled_from("aZ09_-.") | st.characters(codec="utf-8")
_SUFFIXES = st.sampled_from(["", ".turn-3", ".turn-", ".paused", ".fire", ".", "x.turn-10", ".pausedx"])


@given(body=st.text(alphabet=_ID_ALPHABET, max_size=205), suffix=_SUFFIXES)
@example(body="a" * 200, suffix="")
@example(body="a" * 201, suffix="")
@example(body="run", suffix=".turn-0")
@example(body="run\n", suffix="")
def test_the_id_check_agrees_with_the_spec_rules(body: str, suffix: str) -> None:
    session_id = body + suffix
    allowed = _spec_allows(session_id)
    if allowed:
        assert validate_session_id(session_id) == session_id
    else:
        with pytest.raises(errors.SessionIdInvalidError):
            validate_session_id(session_id)
