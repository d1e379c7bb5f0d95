"""History stays linear in a run's length: entries share the transcript with the entry before them."""

from __future__ import annotations

from collections.abc import Callable

import psycopg

from producer.client import Client
from store import payloads
from store.checkpoints import PostgresCheckpointStore
from tests.support import services
from tests.support.driver import Driver
from worker import Agent, tool
from worker.providers import MockModel

STEPS = 200


@tool
def note(index: int) -> str:
    """Write a note."""
    return f"note {index}: " + "x" * 200


def _long_agent() -> Agent:
    def script(messages):  # type: ignore[no-untyped-def]
        turn = sum(1 for m in messages if m.role == "assistant")
        if turn + 1 >= STEPS:
            return "done"
        return {"tool_calls": [{"name": "note", "args": {"index": turn}}], "text": f"turn {turn}"}

    return Agent(name="long", model=MockModel(script), tools=[note], max_steps=STEPS)


def test_a_200_step_run_keeps_a_bounded_linear_history(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore
) -> None:
    ring = PostgresCheckpointStore(store.engine, history_limit=50)  # the default LOUSHO_HISTORY_LIMIT
    driver = make_driver(_long_agent())
    driver.deps.store = ring
    client.agent("long").send("write notes", session_id="long-1")
    driver.drain("long-1", limit=10 * STEPS)
    final = ring.load("long-1")
    assert final is not None and final.status == "finished" and final.step == STEPS
    with psycopg.connect(services.test_database_url()) as conn:
        rows, stored, text_bytes = conn.execute(
            "SELECT count(*), sum(pg_column_size(document)), sum(octet_length(document::text))"
            " FROM checkpoint_history WHERE session_id = 'long-1'"
        ).fetchone()  # type: ignore[misc]
        latest = conn.execute("SELECT octet_length(document::text) FROM runs WHERE session_id = 'long-1'").fetchone()[0]  # type: ignore[index]
    entries = ring.history("long-1")
    full_copies = sum(len(payloads.dumps(e.checkpoint.document())) for e in entries)
    print(
        f"\nhistory of a {STEPS}-step run ({final.seq} saves, limit 50): {rows} rows, {stored} bytes stored"
        f" ({stored // rows} per entry), {text_bytes} bytes as JSON text ({text_bytes // rows} per entry);"
        f" whole copies of the {len(entries)} entries would be {full_copies} bytes; final checkpoint {latest} bytes"
    )
    assert text_bytes * 3 < full_copies
    newest = ring.history("long-1", limit=5)
    assert [e.seq for e in newest] == list(range(final.seq, final.seq - 5, -1))
    assert newest[0].checkpoint.messages == final.messages
    assert len(newest[4].checkpoint.messages) < len(final.messages)


def test_the_ring_keeps_the_newest_entries_and_every_kept_one_rebuilds(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore
) -> None:
    ring = PostgresCheckpointStore(store.engine, history_limit=50)
    driver = make_driver(_long_agent())
    driver.deps.store = ring
    client.agent("long").send("write notes", session_id="long-2")
    driver.drain("long-2", limit=10 * STEPS)
    final = ring.load("long-2")
    assert final is not None and final.status == "finished"
    entries = ring.history("long-2")
    assert [e.seq for e in entries] == list(range(final.seq, final.seq - 50, -1))
    with psycopg.connect(services.test_database_url()) as conn:
        kept, total = conn.execute(
            "SELECT count(*), sum(pg_column_size(document)) FROM checkpoint_history WHERE session_id = 'long-2'"
        ).fetchone()  # type: ignore[misc]
    print(f"\nring of 50 for a {STEPS}-step run: {kept} rows kept, {total} bytes, {total // kept} bytes per entry")
    assert 50 <= kept < 50 + 16
    for entry in entries:
        assert len(entry.checkpoint.messages) >= 2 and entry.checkpoint.messages[0].role == "user"
    fork = client.agent("long").fork("long-2", from_step=entries[-1].step)
    assert fork.checkpoint.messages == entries[-1].checkpoint.messages
