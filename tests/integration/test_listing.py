"""The runs listing on the real Postgres: a page is one index range of ``runs``, whatever its depth, and no
transcript is read, however long the runs' transcripts are."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import event, text

from store.checkpoints import PostgresCheckpointStore
from store.records import RunsPage
from tests.support import services

pytestmark = pytest.mark.integration


def _plans(store: PostgresCheckpointStore, **arguments: Any) -> tuple[RunsPage, list[str]]:
    """The page ``list_runs(**arguments)`` returns, and the plan of each statement it sent."""
    sent: list[tuple[str, Any]] = []

    def seen(conn: Any, cursor: Any, statement: str, parameters: Any, *rest: Any) -> None:
        sent.append((statement, parameters))

    event.listen(store.engine, "before_cursor_execute", seen)
    try:
        page = store.list_runs(**arguments)
    finally:
        event.remove(store.engine, "before_cursor_execute", seen)
    with store.engine.connect() as conn:
        plans = [
            "\n".join(row[0] for row in conn.exec_driver_sql(f"EXPLAIN {statement}", parameters))
            for statement, parameters in sent
        ]
    return page, plans


def test_a_page_of_runs_is_one_index_range_without_transcripts(store: PostgresCheckpointStore) -> None:
    services.reset_state()
    with store.engine.begin() as conn:
        # 3,000 runs over three agents, each with a transcript of 20 long messages
        conn.execute(
            text("""INSERT INTO runs (session_id, agent, status, created_at, updated_at, document)
                             SELECT 'lst-' || g, 'agent-' || (g % 3),
                                    CASE WHEN g % 4 = 0 THEN 'finished' ELSE 'in-progress' END,
                                    now() - make_interval(secs => g), now(), '{"format": 2}'
                             FROM generate_series(1, 3000) g""")
        )
        conn.execute(
            text("""INSERT INTO run_messages (session_id, slot, seq, message)
                             SELECT 'lst-' || g, s, 1, jsonb_build_object('role', 'user', 'content', repeat('x', 2000))
                             FROM generate_series(1, 3000) g, generate_series(0, 19) s""")
        )
        conn.execute(text("ANALYZE runs; ANALYZE run_messages"))

    first, plans = _plans(store, limit=50)
    assert [run.session_id for run in first.items] == [f"lst-{g}" for g in range(1, 51)]
    deep = first
    for _ in range(30):  # 1,500 runs down
        assert deep.next_cursor is not None
        deep = store.list_runs(limit=50, cursor=deep.next_cursor)
    assert deep.items[0].session_id == "lst-1501"
    _, deep_plans = _plans(store, limit=50, cursor=deep.next_cursor)
    _, filtered = _plans(store, limit=50, agents=["agent-1"], states=["running"], cursor=deep.next_cursor)
    for plan in (*plans, *deep_plans):
        assert "Index Scan Backward using runs_created_idx" in plan, plan
        assert "Seq Scan" not in plan and "Sort" not in plan, plan
    # With filters the planner may read the table instead (its guess of what the filters keep decides);
    # never the transcripts.
    assert filtered and all("run_messages" not in plan for plan in (*plans, *deep_plans, *filtered))


def test_a_detailed_page_lists_runs_whose_documents_hold_usage_it_does_not_know(store: PostgresCheckpointStore) -> None:
    services.reset_state()
    with store.engine.begin() as conn:
        conn.execute(
            text("""INSERT INTO runs (session_id, agent, status, document) VALUES
            ('odd-usage', 'shop', 'finished', '{"format": 2, "step": 4, "usage": {"input_tokens": 5, "requests": 10}}'),
            ('bad-usage', 'shop', 'finished', '{"format": 2, "step": "many", "usage": "lots"}')""")
        )

    page = {run.session_id: run for run in store.list_runs(details=True).items}

    assert page["odd-usage"].usage is not None and page["odd-usage"].usage.input_tokens == 5
    assert page["odd-usage"].step == 4
    assert page["bad-usage"].usage is None and page["bad-usage"].step is None
