"""Format 2: a step writes only what it adds, claims read only what a process has not seen, format 1 still reads."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import psycopg
from psycopg.types.json import Jsonb

from producer.client import Client
from store.checkpoints import PostgresCheckpointStore
from store.records import Message, ToolCall
from tests.fakes.store_contract.subject import save_next
from tests.support import services
from tests.support.driver import Driver
from worker import Agent, tool
from worker.providers import MockModel

STEPS = 301
RESULT = "r" * 1024


@tool
def fetch(index: int) -> str:
    """Fetch a page."""
    return f"page {index} " + RESULT


def _long_agent() -> Agent:
    def script(messages):  # type: ignore[no-untyped-def]
        turn = sum(1 for m in messages if m.role == "assistant")
        if turn + 1 >= (STEPS + 1) // 2:
            return "done"
        return {"tool_calls": [{"name": "fetch", "args": {"index": turn}}], "text": f"turn {turn}"}

    return Agent(name="long", model=MockModel(script), tools=[fetch], max_steps=STEPS)


def _per_save(session_id: str) -> dict[int, int]:
    """Bytes each save of the run stored: its message rows plus its history entry."""
    with psycopg.connect(services.test_database_url()) as conn:
        rows = conn.execute(
            "SELECT seq, sum(pg_column_size(m.*)) FROM run_messages m WHERE session_id = %s GROUP BY seq", (session_id,)
        ).fetchall()
        entries = conn.execute(
            "SELECT seq, pg_column_size(h.*) FROM checkpoint_history h WHERE session_id = %s", (session_id,)
        ).fetchall()
    stored: dict[int, int] = {}
    for seq, size in [*rows, *entries]:
        stored[seq] = stored.get(seq, 0) + int(size)
    return stored


def test_a_save_stores_the_same_bytes_at_step_20_and_at_step_280(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore
) -> None:
    ring = PostgresCheckpointStore(store.engine, history_limit=STEPS + 10)  # keep every entry to measure it
    driver = make_driver(_long_agent())
    driver.deps.store = ring
    client.agent("long").send("read pages", session_id="flat-1")
    driver.drain("flat-1", limit=4 * STEPS)
    final = ring.load("flat-1")
    assert final is not None and final.status == "finished" and len(final.messages) == STEPS + 1
    stored = _per_save("flat-1")
    early = [stored[seq] for seq in range(20, 40)]
    late = [stored[seq] for seq in range(final.seq - 40, final.seq - 20)]
    print(
        f"\nbytes stored per save of a {final.seq}-save run with 1 KB results: saves 20-39 {sum(early) / 20:.0f},"
        f" saves {final.seq - 40}-{final.seq - 21} {sum(late) / 20:.0f}; total {sum(stored.values())}"
    )
    # Without append-only rows a late save would rewrite ~150 KB of transcript.
    assert sum(late) / sum(early) < 1.1
    with psycopg.connect(services.test_database_url()) as conn:
        document = conn.execute("SELECT document FROM runs WHERE session_id = 'flat-1'").fetchone()[0]  # type: ignore[index]
    assert "messages" not in document and document["messages_count"] == STEPS + 1 and document["format"] == 2
    entries = ring.history("flat-1", limit=3)
    assert entries[0].checkpoint.messages == final.messages
    assert len(entries[2].checkpoint.messages) == len(final.messages) - 2


def _run_with_turn(store: PostgresCheckpointStore, session_id: str):  # type: ignore[no-untyped-def]
    store.append_input(session_id, "agent", [Message(role="user", content="hi")])
    claim = store.claim(session_id, 1, None)
    assert claim.checkpoint is not None
    turn = Message(role="assistant", tool_calls=[ToolCall(id="a", name="t"), ToolCall(id="b", name="t")])
    return save_next(store, claim.checkpoint, messages=[Message(role="user", content="hi"), turn], inbox_cursor=1)


def test_a_claim_reads_only_the_rows_a_process_has_not_seen(store: PostgresCheckpointStore) -> None:
    warm = store
    saved = _run_with_turn(warm, "tail-1")
    # Another process (a store of its own) settles result b, then a.
    other = PostgresCheckpointStore(store.engine)
    theirs = other.claim("tail-1", 2, None).checkpoint
    assert theirs is not None and theirs.messages == saved.messages
    result_b = Message(role="tool", tool_call_id="b", name="t", content="B")
    theirs = save_next(other, theirs.with_tool_result(result_b))
    theirs = save_next(other, theirs.with_tool_result(Message(role="tool", tool_call_id="a", name="t", content="A")))
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        slots = conn.execute("SELECT slot, seq FROM run_messages WHERE session_id = 'tail-1' ORDER BY slot").fetchall()
        # Proof that the warm process does not read the first rows again: change one behind its back.
        conn.execute(
            "UPDATE run_messages SET message = %s WHERE session_id = 'tail-1' AND slot = 0",
            (Jsonb({"role": "user", "content": "changed"}),),
        )
    assert slots == [(0, 1), (1, 1), (2, 3), (3, 2)]
    mine = warm.claim("tail-1", 3, None).checkpoint
    assert mine is not None and [m.content for m in mine.messages] == ["hi", None, "A", "B"]
    cold = PostgresCheckpointStore(store.engine).claim("tail-1", 4, None).checkpoint
    assert cold is not None and [m.content for m in cold.messages] == ["changed", None, "A", "B"]


def test_a_rewritten_transcript_is_read_whole_by_every_process(store: PostgresCheckpointStore) -> None:
    saved = _run_with_turn(store, "rewrite-1")
    other = PostgresCheckpointStore(store.engine)
    theirs = other.claim("rewrite-1", 2, None).checkpoint
    assert theirs is not None
    save_next(other, theirs, messages=[Message(role="user", content="replaced")])
    mine = store.claim("rewrite-1", 3, None).checkpoint
    assert mine is not None and [m.content for m in mine.messages] == ["replaced"]
    assert len(saved.messages) == 2
    with psycopg.connect(services.test_database_url()) as conn:
        assert conn.execute("SELECT count(*) FROM run_messages WHERE session_id = 'rewrite-1'").fetchone() == (1,)


def test_a_run_stored_in_format_1_is_read_and_moves_to_format_2_at_its_next_save(
    store: PostgresCheckpointStore,
) -> None:
    old_messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "a", "name": "t", "args": {"q": 1}}]},
    ]
    document = {"messages": old_messages, "step": 1, "agent": "agent", "history_seq": 1}
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        # As the previous release wrote it: the whole transcript in the document, a keyframe entry.
        conn.execute(
            "INSERT INTO runs (session_id, agent, status, seq, inbox_head, inbox_cursor, document)"
            " VALUES ('old-1', 'agent', 'in-progress', 1, 1, 1, %s)",
            (Jsonb(document),),
        )
        conn.execute(
            "INSERT INTO checkpoint_history (session_id, seq, fence, step, status, document)"
            " VALUES ('old-1', 1, 1, 1, 'in-progress', %s)",
            (Jsonb(document),),
        )
        # A deleted run's leftover row under the same id must not leak into it.
        conn.execute(
            "INSERT INTO run_messages (session_id, slot, seq, message) VALUES ('old-1', 5, 9, %s)",
            (Jsonb({"role": "user", "content": "leftover"}),),
        )
    # Readers take the document's transcript, never the leftover row.
    read = store.load("old-1")
    assert read is not None and [m.dump() for m in read.messages] == old_messages
    listed = [c for c in store.list() if c.session_id == "old-1"]
    assert [[m.dump() for m in c.messages] for c in listed] == [old_messages]  # type: ignore[union-attr]
    claimed = store.claim("old-1", 5, None).checkpoint
    assert claimed is not None and [m.dump() for m in claimed.messages] == old_messages
    result = Message(role="tool", tool_call_id="a", name="t", content="done")
    save_next(store, claimed.with_tool_result(result))
    with psycopg.connect(services.test_database_url()) as conn:
        stored = conn.execute("SELECT document FROM runs WHERE session_id = 'old-1'").fetchone()[0]  # type: ignore[index]
        rows = conn.execute(
            "SELECT slot, message FROM run_messages WHERE session_id = 'old-1' ORDER BY slot"
        ).fetchall()
    assert "messages" not in stored and stored["messages_count"] == 3
    assert [slot for slot, _ in rows] == [0, 1, 2] and rows[2][1]["content"] == "done"
    loaded = PostgresCheckpointStore(store.engine).load("old-1")
    assert loaded is not None and [m.dump() for m in loaded.messages] == [*old_messages, result.dump()]
    history = store.history("old-1")
    assert [(e.seq, len(e.checkpoint.messages)) for e in history] == [(2, 3), (1, 2)]
    assert json.loads(json.dumps(history[1].checkpoint.messages[1].dump())) == old_messages[1]


def test_a_claim_that_waited_for_the_previous_holders_save_sees_the_rows_of_that_save(
    store: PostgresCheckpointStore,
) -> None:
    saved = _run_with_turn(store, "takeover-1")
    assert len(saved.messages) == 2
    result = {"role": "tool", "tool_call_id": "a", "name": "t", "content": "A"}
    claimed: list[object] = []
    with psycopg.connect(services.test_database_url()) as previous:
        # The previous holder's save, not yet committed: the run's row is locked by it.
        previous.execute(
            "UPDATE runs SET seq = seq + 1, document = jsonb_set(document, '{messages_count}', '3')"
            " WHERE session_id = 'takeover-1'"
        )
        previous.execute(
            "INSERT INTO run_messages (session_id, slot, seq, message) VALUES ('takeover-1', 2, 2, %s)",
            (Jsonb(result),),
        )
        waiting = threading.Thread(target=lambda: claimed.append(_claim_or_error(store, "takeover-1", 9)))
        waiting.start()
        _until_blocked_by(previous.info.backend_pid)  # the claim now waits for the row lock
        previous.commit()
    waiting.join(10)
    outcome = claimed[0]
    print(f"\nclaim that waited for a save: {outcome!r}"[:200])
    assert not isinstance(outcome, Exception), outcome
    assert [m.dump() for m in outcome.messages][2] == result  # type: ignore[attr-defined]


def _until_blocked_by(holder_pid: int, timeout: float = 10.0) -> None:
    """Until some session waits for a lock the backend ``holder_pid`` holds; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(services.test_database_url(), autocommit=True) as observer:
        while not observer.execute(
            "SELECT 1 FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (holder_pid,)
        ).fetchone():
            assert time.monotonic() < deadline, f"nothing waited for backend {holder_pid} within {timeout} s"
            time.sleep(0.01)


def _claim_or_error(store: PostgresCheckpointStore, session_id: str, token: int) -> object:
    try:
        return store.claim(session_id, token, None).checkpoint
    except Exception as exc:  # the outcome is asserted by the test
        return exc


def test_a_new_run_starts_in_format_2_without_a_deleted_runs_leftover_rows(store: PostgresCheckpointStore) -> None:
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        # Rows a release before format 2 left when it deleted a run of this id.
        conn.execute(
            "INSERT INTO run_messages (session_id, slot, seq, message) VALUES ('left-2', 0, 4, %s)",
            (Jsonb({"role": "user", "content": "leftover"}),),
        )
    store.append_input("left-2", "agent", [Message(role="user", content="fresh")])
    with psycopg.connect(services.test_database_url()) as conn:
        document = conn.execute("SELECT document FROM runs WHERE session_id = 'left-2'").fetchone()[0]  # type: ignore[index]
        left = conn.execute("SELECT count(*) FROM run_messages WHERE session_id = 'left-2'").fetchone()
    assert document == {"format": 2, "messages_count": 0} and left == (0,)
    claimed = store.claim("left-2", 1, None).checkpoint
    assert claimed is not None and claimed.messages == []
