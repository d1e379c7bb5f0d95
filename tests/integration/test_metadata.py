"""Metadata sent with input and limits given on resume, through a real client on Postgres (no worker runs)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from producer import Client, ConfigurationError, InputTooLargeError, Limits
from store.checkpoints import PostgresCheckpointStore
from store.records import LastError

pytestmark = pytest.mark.integration


def _stored_format(store: PostgresCheckpointStore, session_id: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(
            text("SELECT document ->> 'format' FROM runs WHERE session_id = :sid"), {"sid": session_id}
        ).scalar_one()


def test_metadata_sent_with_input_is_read_back_with_its_inbox_entry(
    client: Client, store: PostgresCheckpointStore
) -> None:
    shop = client.agent("shop")
    metadata = {"tenant": "acme", "plan": {"tier": "pro", "seats": 12}, "flags": ["beta"], "ratio": 0.5}

    first = shop.send("Charge order 7", session_id="meta-1", metadata=metadata)
    second = shop.send("And ship it", session_id="meta-1")
    third = shop.send("Refund", session_id="meta-1", metadata={"reason": "late"}, idempotency_key="req-9")
    again = shop.send("Refund", session_id="meta-1", metadata={"reason": "changed"}, idempotency_key="req-9")

    entries = store.inbox("meta-1", 0)
    assert (first.input_number, second.input_number, third.input_number, again.input_number) == (1, 2, 3, 3)
    assert [(e.n, e.metadata) for e in entries] == [(1, metadata), (2, None), (3, {"reason": "late"})]
    assert [m.content for m in entries[0].messages] == ["Charge order 7"]


def test_stream_sends_its_metadata_with_the_input(client: Client, store: PostgresCheckpointStore) -> None:
    events = client.agent("shop").stream("hi", session_id="meta-stream", metadata={"tenant": "acme"}, timeout=0.1)

    (entry,) = store.inbox("meta-stream", 0)
    assert entry.metadata == {"tenant": "acme"}
    del events


def test_metadata_without_input_is_refused(client: Client, store: PostgresCheckpointStore) -> None:
    shop = client.agent("shop")
    shop.send("first", session_id="meta-empty")

    with pytest.raises(ConfigurationError, match="metadata"):
        shop.send([], session_id="meta-empty", metadata={"tenant": "acme"})
    assert [e.metadata for e in store.inbox("meta-empty", 0)] == [None]


def test_metadata_text_is_cleaned_as_input_is(client: Client, store: PostgresCheckpointStore) -> None:
    client.agent("shop").send("hi", session_id="meta-nul", metadata={"note": "a\x00b"})

    (entry,) = store.inbox("meta-nul", 0)
    assert entry.metadata == {"note": "a\ufffdb"}


@pytest.mark.parametrize(
    ("metadata", "error"),
    [
        ("plan=pro", ConfigurationError),
        ([{"plan": "pro"}], ConfigurationError),
        ({"plan": {1, 2}}, ConfigurationError),
        ({"plan": float("nan")}, ConfigurationError),
        ({"blob": "x" * 17_000}, InputTooLargeError),
        ({"many": ["y" * 100] * 200}, InputTooLargeError),
    ],
    ids=["string", "list", "set-value", "nan", "large-string", "large-list"],
)
def test_metadata_that_is_not_a_small_json_object_is_refused_before_anything_is_written(
    client: Client, store: PostgresCheckpointStore, metadata: Any, error: type[Exception]
) -> None:
    shop = client.agent("shop")
    shop.send("first", session_id="meta-old")

    with pytest.raises(error):
        shop.send("hello", session_id="meta-new", metadata=metadata)
    with pytest.raises(error):
        shop.send("more", session_id="meta-old", metadata=metadata)
    with pytest.raises(error):
        list(shop.stream("hello", session_id="meta-streamed", metadata=metadata, timeout=1))

    assert store.load("meta-new") is None and store.load("meta-streamed") is None
    assert [e.n for e in store.inbox("meta-old", 0)] == [1]


def test_resume_with_limits_writes_them_into_the_run(client: Client, store: PostgresCheckpointStore) -> None:
    shop = client.agent("shop")
    shop.send("Charge order 7", session_id="lim-1")
    claim = store.claim("lim-1", 1, None)
    assert claim.checkpoint is not None
    store.record_failure("lim-1", 1, LastError(code="X", message="stopped", retryable=False))
    limits = Limits(max_cost=3.0, max_output_tokens=20_000)

    run = shop.resume("lim-1", limits=limits)

    loaded = store.load("lim-1")
    assert run is not None and loaded is not None
    assert loaded.limits == {"max_cost": 3.0, "max_output_tokens": 20_000} and loaded.last_error is None
    assert _stored_format(store, "lim-1") == "3"
    # Client.resume writes them the same way; a resume without limits keeps those given.
    assert client.resume("lim-1", limits=Limits(max_duration_s=60)) is not None
    assert (loaded := store.load("lim-1")) is not None and loaded.limits == {"max_duration_s": 60}
    assert client.resume("lim-1") is not None
    assert (loaded := store.load("lim-1")) is not None and loaded.limits == {"max_duration_s": 60}


def test_resume_refuses_limits_that_are_not_limits(client: Client, store: PostgresCheckpointStore) -> None:
    client.agent("shop").send("hi", session_id="lim-bad")

    with pytest.raises(ConfigurationError):
        client.resume("lim-bad", limits={"max_cost": 3.0})  # type: ignore[arg-type]  # the mistake under test
    with pytest.raises(ConfigurationError):
        client.agent("shop").resume("lim-bad", limits={"max_cost": 3.0})  # type: ignore[arg-type]  # as above

    loaded = store.load("lim-bad")
    assert loaded is not None and loaded.limits is None
    assert _stored_format(store, "lim-bad") == "2"
