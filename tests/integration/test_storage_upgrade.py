"""``store.upgrade``: runs stored in checkpoint format 1 move to format 2, unchanged as read, beside live workers.

Runs are written with SQL as a worker of the previous release left them (the whole transcript in the document,
format-1 history entries); every run is compared through the store before and after.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from store import upgrade
from store.checkpoints import PostgresCheckpointStore
from store.records import Message
from store.transcripts import slots_of
from store.upgrade import UpgradeReport, upgrade_runs
from tests.fakes.store_contract.subject import save_next
from tests.support import services

USER = {"role": "user", "content": "Weather in Oslo and Rome?"}
CALLS = {
    "role": "assistant",
    "content": "Looking.",
    "tool_calls": [
        {"id": "call_a", "name": "lookup", "args": {"city": "Oslo"}},
        {"id": "call_b", "name": "lookup", "args": {"city": "Rome"}},
    ],
}
RESULT_A = {"role": "tool", "tool_call_id": "call_a", "name": "lookup", "content": "sunny in Oslo"}
RESULT_B = {"role": "tool", "tool_call_id": "call_b", "name": "lookup", "content": "rain in Rome", "is_error": False}
ANSWER = {"role": "assistant", "content": "Sunny in Oslo, rain in Rome."}
USAGE = {"input_tokens": 30, "output_tokens": 12, "total_tokens": 42}


def _sql(statement: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        cursor = conn.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


def _old_run(
    session_id: str, status: str, seq: int, document: dict[str, Any], *, last_error: Any = None, uncounted: Any = None
) -> None:
    """A run row as the previous release wrote it (format 1: the transcript in the document)."""
    _sql(
        "INSERT INTO runs (session_id, agent, status, seq, fence, inbox_head, inbox_cursor, document, last_error,"
        " uncounted_usage) VALUES (%s, 'weather', %s, %s, %s, 1, 1, %s, %s, %s)",
        session_id,
        status,
        seq,
        seq,
        Jsonb(document),
        None if last_error is None else Jsonb(last_error),
        None if uncounted is None else Jsonb(uncounted),
    )


def _entry(session_id: str, seq: int, status: str, document: dict[str, Any]) -> None:
    _sql(
        "INSERT INTO checkpoint_history (session_id, seq, fence, step, status, document)"
        " VALUES (%s, %s, %s, %s, %s, %s)",
        session_id,
        seq,
        seq,
        document.get("step", 0),
        status,
        Jsonb(document),
    )


def _finished_run() -> None:
    """Three saves: the tool turn, its two results, the answer; history as a keyframe and two deltas."""
    messages = [USER, CALLS, RESULT_A, RESULT_B, ANSWER]
    common = {"agent": "weather", "usage": USAGE, "fingerprint": {"tools": {"lookup": "x"}}}
    _old_run(
        "done-1", "finished", 3, {**common, "messages": messages, "step": 2, "finish_reason": "stop", "history_seq": 3}
    )
    _entry("done-1", 1, "in-progress", {**common, "messages": messages[:2], "step": 1, "history_seq": 1})
    _entry(
        "done-1",
        2,
        "in-progress",
        {**common, "messages_keep": 2, "messages_tail": messages[2:4], "step": 1, "history_seq": 2},
    )
    _entry(
        "done-1",
        3,
        "finished",
        {
            **common,
            "messages_keep": 4,
            "messages_tail": messages[4:],
            "step": 2,
            "finish_reason": "stop",
            "history_seq": 3,
        },
    )


def _paused_run() -> None:
    """Paused on an approval, with usage of a model call not saved yet (kept in its column)."""
    transfer = {"role": "assistant", "tool_calls": [{"id": "call_t", "name": "transfer", "args": {"amount": 10}}]}
    document = {
        "agent": "weather",
        "messages": [{"role": "user", "content": "Move 10"}, transfer],
        "step": 1,
        "approval_ids": ["ap-1"],
        "usage": USAGE,
        "finish_reason": "awaiting-approval",
        "history_seq": 2,
    }
    _old_run("paused-1", "awaiting-approval", 2, document, uncounted={"input_tokens": 5, "total_tokens": 5})
    _entry("paused-1", 2, "awaiting-approval", document)


def _mixed_run() -> None:
    """Once in format 2 (rows, a format-2 entry), then saved in format 1 by an old worker, then parked.

    Its last turn still misses a result, so its slots are 0, 1, 3; slot 2 holds a stray row.
    """
    _sql(
        "INSERT INTO run_messages (session_id, slot, seq, message) VALUES ('mixed-1', 0, 1, %s),"
        " ('mixed-1', 1, 1, %s), ('mixed-1', 2, 5, %s)",
        Jsonb(USER),
        Jsonb(CALLS),
        Jsonb({"role": "user"}),
    )
    _entry(
        "mixed-1", 1, "in-progress", {"agent": "weather", "format": 2, "messages_count": 2, "step": 1, "history_seq": 1}
    )
    document = {
        "agent": "weather",
        "messages": [USER, CALLS, RESULT_B],
        "step": 1,
        "history_seq": 2,
        "started_tool_call_ids": ["call_a"],
    }
    _entry("mixed-1", 2, "in-progress", document)
    _old_run(
        "mixed-1",
        "in-progress",
        2,
        document,
        last_error={"code": "LOUSHO_AGENT_DRIFT", "message": "drift", "retryable": False},
    )


def _old_runs() -> None:
    _finished_run()
    _paused_run()
    _mixed_run()
    # Parked before its first turn: a transcript of no message.
    _old_run(
        "empty-1",
        "in-progress",
        1,
        {"agent": "weather", "messages": [], "step": 0},
        last_error={"code": "LOUSHO_CONFIG_INVALID", "message": "bad", "retryable": False},
    )
    _old_run("broken-1", "finished", 4, {"agent": "weather", "messages": [{"role": "robot"}], "step": 1})


def _documents() -> dict[str, dict[str, Any]]:
    return dict(_sql("SELECT session_id, document FROM runs"))


def _rows(session_id: str) -> list[tuple[int, int, dict[str, Any]]]:
    return _sql("SELECT slot, seq, message FROM run_messages WHERE session_id = %s ORDER BY slot", session_id)


CONVERTED = ("done-1", "paused-1", "mixed-1", "empty-1")


def test_every_format_1_run_is_converted_and_reads_as_before(store: PostgresCheckpointStore) -> None:
    _old_runs()
    old_documents = _documents()
    # What each run holds: as loaded, with the transcript of its document (load() of a format-1 run that
    # has stray rows, mixed-1, shows the rows instead).
    before = {
        sid: store.load(sid).model_copy(  # type: ignore[union-attr]
            update={"messages": [Message.model_validate(m) for m in old_documents[sid]["messages"]]}
        )
        for sid in CONVERTED
    }
    assert all(store.load(sid) == before[sid] for sid in CONVERTED if sid != "mixed-1")
    histories = {sid: store.history(sid) for sid in CONVERTED}
    transcript_ids = dict(_sql("SELECT session_id, transcript_id FROM runs"))

    report = upgrade_runs(store.engine, batch=2)  # three pages

    assert report == UpgradeReport(converted=4, skipped=0, unreadable=1, unreadable_runs=["broken-1"])
    documents = _documents()
    seqs = dict(_sql("SELECT session_id, seq FROM runs"))
    after_ids = dict(_sql("SELECT session_id, transcript_id FROM runs"))
    fresh = PostgresCheckpointStore(store.engine)  # remembers nothing of any run
    for sid in CONVERTED:
        old = before[sid]
        messages = [m.dump() for m in old.messages]
        assert "messages" not in documents[sid]
        assert documents[sid]["format"] == 2 and documents[sid]["messages_count"] == len(messages)
        assert _rows(sid) == [(slot, seqs[sid], m) for slot, m in zip(slots_of(old.messages), messages, strict=True)]
        assert fresh.load(sid) == old, sid
        assert after_ids[sid] != transcript_ids[sid]
        assert fresh.history(sid) == histories[sid], sid
    assert [len(histories[sid]) for sid in CONVERTED] == [3, 1, 2, 0]
    assert [m.content for m in before["done-1"].messages] == [
        USER["content"],
        "Looking.",
        "sunny in Oslo",
        "rain in Rome",
        ANSWER["content"],
    ]
    # Unsaved usage stays in its column, counted once.
    assert before["paused-1"].usage.total_tokens == 47
    # The parked run's last turn misses a result: slots 0, 1, 3, and the stray row at slot 2 is gone.
    assert [slot for slot, _, _ in _rows("mixed-1")] == [0, 1, 3]
    claimed = fresh.claim("mixed-1", 100, None).checkpoint
    assert claimed is not None and claimed.messages == before["mixed-1"].messages
    assert documents["broken-1"] == old_documents["broken-1"] and _rows("broken-1") == []
    assert after_ids["broken-1"] == transcript_ids["broken-1"]

    assert upgrade_runs(store.engine) == UpgradeReport(unreadable=1, unreadable_runs=["broken-1"])


@pytest.mark.parametrize(
    "change",
    [
        "UPDATE runs SET seq = seq + 1",  # an old worker's save
        "UPDATE runs SET fence = fence + 1",  # a step's claim
        "UPDATE runs SET transcript_id = nextval('run_transcript_ids')",  # deleted, and created again
    ],
)
def test_a_run_that_moves_between_its_reading_and_its_conversion_is_skipped(
    store: PostgresCheckpointStore, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    _finished_run()
    read = upgrade._read_run

    def read_then_move(conn: Any, session_id: str) -> Any:
        row = read(conn, session_id)
        _sql(change + " WHERE session_id = %s", session_id)  # the run moves meanwhile
        moved.extend(_sql("SELECT transcript_id FROM runs"))
        return row

    moved: list[tuple[Any, ...]] = []
    monkeypatch.setattr(upgrade, "_read_run", read_then_move)

    report = upgrade_runs(store.engine)

    assert report == UpgradeReport(skipped=1)
    assert "messages" in _documents()["done-1"] and _rows("done-1") == []
    assert _sql("SELECT transcript_id FROM runs") == moved
    monkeypatch.undo()
    assert upgrade_runs(store.engine) == UpgradeReport(converted=1)
    assert "messages" not in _documents()["done-1"] and len(_rows("done-1")) == 5


def test_a_claim_between_the_rows_and_the_document_leaves_the_run_to_the_step(
    store: PostgresCheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _finished_run()
    write = upgrade._write_rows
    claimed: list[Any] = []

    def write_then_claim(*args: Any) -> bool:
        written = write(*args)
        claimed.append(store.claim("done-1", 50, None).checkpoint)
        return written

    monkeypatch.setattr(upgrade, "_write_rows", write_then_claim)

    assert upgrade_runs(store.engine) == UpgradeReport(skipped=1)

    # The claim read the format-1 document; the rows written are ignored until a save replaces them.
    [checkpoint] = claimed
    assert [m.dump() for m in checkpoint.messages] == [USER, CALLS, RESULT_A, RESULT_B, ANSWER]
    assert "messages" in _documents()["done-1"] and len(_rows("done-1")) == 5
    more = Message(role="user", content="And tomorrow?")
    saved = save_next(store, checkpoint, messages=[*checkpoint.messages, more])
    assert _documents()["done-1"]["messages_count"] == 6 and len(_rows("done-1")) == 6
    loaded = PostgresCheckpointStore(store.engine).load("done-1")
    assert loaded is not None and loaded.messages == saved.messages
    assert [(e.seq, len(e.checkpoint.messages)) for e in store.history("done-1")] == [(4, 6), (3, 5), (2, 4), (1, 2)]
    monkeypatch.undo()
    assert upgrade_runs(store.engine) == UpgradeReport()


def test_a_step_that_claimed_the_run_before_the_conversion_still_saves_after_it(store: PostgresCheckpointStore) -> None:
    _mixed_run()
    _sql("UPDATE runs SET last_error = NULL WHERE session_id = 'mixed-1'")
    claimed = store.claim("mixed-1", 10, None).checkpoint
    assert claimed is not None

    assert upgrade_runs(store.engine) == UpgradeReport(converted=1)

    result = Message.model_validate(RESULT_A)
    saved = save_next(store, claimed.with_tool_result(result))
    loaded = PostgresCheckpointStore(store.engine).load("mixed-1")
    assert loaded is not None and loaded.messages == saved.messages
    assert [m.dump() for m in loaded.messages] == [USER, CALLS, RESULT_A, RESULT_B]
    assert [(slot, seq) for slot, seq, _ in _rows("mixed-1")] == [(0, 2), (1, 2), (2, 3), (3, 2)]
    assert [(e.seq, len(e.checkpoint.messages)) for e in store.history("mixed-1")] == [(3, 4), (2, 3), (1, 2)]


def test_a_batch_below_one_is_refused() -> None:
    from store import errors

    with pytest.raises(errors.ConfigurationError):
        upgrade_runs(None, batch=0)  # type: ignore[arg-type]
