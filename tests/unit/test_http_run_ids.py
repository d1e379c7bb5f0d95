"""Delivery id -> run id: never a fork, a child task or a reserved key of another run; one run id per delivery."""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st

from store import records
from store.deliveries import session_id_for

PRINTABLE = "".join(chr(c) for c in range(0x21, 0x7F))
#: Suffixes that name another key of a run: forks, child tasks, session turns, paused sessions, schedule fires.
ADDRESSING = (".fork-1", ".fork-12", ".task-0123456789abcdef", ".turn-3", ".paused", ".fire")

agents = st.from_regex(r"[A-Za-z0-9_.-]{1,200}", fullmatch=True)
plain_agents = st.from_regex(r"[A-Za-z0-9_]{1,64}", fullmatch=True)
plain_ids = st.from_regex(r"[A-Za-z0-9_-]{1,128}", fullmatch=True)
delivery_ids = st.text(alphabet=PRINTABLE, min_size=1, max_size=256)
# A small alphabet full of separators, so that different pairs often look alike.
tricky = st.text(alphabet="ab-_.", min_size=1, max_size=6)


@settings(max_examples=400)
@given(agent=agents, delivery_id=delivery_ids)
def test_every_run_id_is_valid_and_has_no_dot(agent: str, delivery_id: str) -> None:
    session_id = session_id_for(agent, delivery_id)
    assert records.validate_session_id(session_id) == session_id
    # Every fork, child task and reserved key of a run is "<run id>.<something>": without a dot, a
    # delivery's run id can be none of them.
    assert "." not in session_id and session_id.startswith("job-")


@settings(max_examples=400)
@given(agent=agents, delivery_id=delivery_ids, suffix=st.sampled_from(ADDRESSING))
def test_a_suffixed_delivery_id_never_addresses_the_plain_deliverys_keys(
    agent: str, delivery_id: str, suffix: str
) -> None:
    base = session_id_for(agent, delivery_id)
    suffixed = session_id_for(agent, delivery_id + suffix)
    assert suffixed != base + suffix and not suffixed.startswith(base + ".")
    assert not suffixed.endswith(suffix)


@settings(max_examples=1000)
@given(
    first=st.tuples(tricky | agents, tricky | delivery_ids), second=st.tuples(tricky | agents, tricky | delivery_ids)
)
def test_two_different_deliveries_never_share_a_run_id(first: tuple[str, str], second: tuple[str, str]) -> None:
    if first != second:
        assert session_id_for(*first) != session_id_for(*second)


@given(agent=plain_agents, delivery_id=plain_ids)
def test_plain_ids_keep_the_readable_run_id_of_earlier_releases(agent: str, delivery_id: str) -> None:
    assert session_id_for(agent, delivery_id) == f"job-{agent}-{delivery_id}"


def test_the_examples_of_the_issue() -> None:
    seen = {session_id_for("hooks", "abc")}
    for suffix in ADDRESSING:
        session_id = session_id_for("hooks", "abc" + suffix)
        print(f"  abc{suffix:24} -> {session_id}")
        assert (
            session_id.startswith("job-h")
            and len(session_id) == 45
            and set(session_id[5:]) <= set(string.hexdigits.lower())
        )
        seen.add(session_id)
    assert len(seen) == 1 + len(ADDRESSING)
    assert session_id_for("hooks", "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W") == "job-hooks-msg_2KWPBgLlAfxdpx2AI54pPJ85f4W"
    assert session_id_for("hooks", "72d3162e-cc78-11e3-81ab-4c9367dc0958") == (
        "job-hooks-72d3162e-cc78-11e3-81ab-4c9367dc0958"
    )
