"""``lousho storage upgrade``: runs stored in checkpoint format 1 are converted, and the counts are printed."""

from __future__ import annotations

import psycopg
import pytest
from psycopg.types.json import Jsonb

from store.checkpoints import PostgresCheckpointStore
from tests.support import services
from tests.support.cli_fixtures import Lousho


def _old_run(session_id: str, document: dict[str, object]) -> None:
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO runs (session_id, agent, status, seq, inbox_head, inbox_cursor, document)"
            " VALUES (%s, 'weather', 'finished', 2, 1, 1, %s)",
            (session_id, Jsonb(document)),
        )


def _formats() -> dict[str, object]:
    with psycopg.connect(services.test_database_url()) as conn:
        return dict(conn.execute("SELECT session_id, document -> 'format' FROM runs").fetchall())


@pytest.mark.integration
def test_storage_upgrade_converts_format_1_runs_and_prints_what_it_did(
    lousho: Lousho, store: PostgresCheckpointStore
) -> None:
    for n in range(3):
        _old_run(
            f"w-{n}",
            {
                "agent": "weather",
                "step": 1,
                "finish_reason": "stop",
                "messages": [
                    {"role": "user", "content": f"question {n}"},
                    {"role": "assistant", "content": f"answer {n}"},
                ],
            },
        )
    _old_run("w-bad", {"agent": "weather", "messages": "not a transcript"})

    printed = lousho("storage", "upgrade", "--batch", "2")
    again = lousho("storage", "upgrade", "--json")

    assert printed.code == 0, printed.err
    assert printed.out == ("converted 3 run(s) to checkpoint format 2\nleft 1 unreadable run(s) as they are: w-bad\n")
    assert _formats() == {"w-0": 2, "w-1": 2, "w-2": 2, "w-bad": None}
    assert again.code == 0, again.err
    assert again.json() == {"converted": 0, "skipped": 0, "unreadable": 1, "unreadable_runs": ["w-bad"]}
    loaded = store.load("w-1")
    assert loaded is not None and [m.content for m in loaded.messages] == ["question 1", "answer 1"]


@pytest.mark.parametrize("batch", ["0", "-5", "many"])
def test_a_batch_size_that_is_not_a_positive_whole_number_is_a_usage_error(lousho: Lousho, batch: str) -> None:
    printed = lousho("storage", "upgrade", "--batch", batch)

    assert printed.code == 2
    assert printed.out == ""
    assert "usage: lousho storage upgrade" in printed.err and "--batch" in printed.err


@pytest.mark.integration
def test_storage_upgrade_refuses_while_a_live_worker_does_not_read_format_2(
    lousho: Lousho, store: PostgresCheckpointStore
) -> None:
    from store.registry import PostgresAgentRegistry

    _old_run("w-old", {"agent": "weather", "step": 1, "messages": [{"role": "user", "content": "q"}]})
    registry = PostgresAgentRegistry(store.engine)
    registry.register("host:1", {"weather": {"hash": "a"}}, [1])
    registry.register("host:2", {"weather": {"hash": "a"}}, [1, 2])

    refused = lousho("storage", "upgrade")
    assert refused.code == 1 and refused.out == ""
    assert "1 live worker(s) do not read checkpoint format 2 (host:1)" in refused.err
    assert _formats() == {"w-old": None}

    forced = lousho("storage", "upgrade", "--force")
    assert forced.code == 0, forced.err
    assert _formats() == {"w-old": 2}
    registry.forget("host:1")
    assert lousho("storage", "upgrade").code == 0
