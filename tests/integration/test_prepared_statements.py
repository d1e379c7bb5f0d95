"""Prepared statements on the driver, and none at all when a pooler in transaction mode sits in between."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from store.database import make_engine
from store.settings import Settings

pytestmark = pytest.mark.integration

_QUERY = "SELECT count(*) FROM runs WHERE session_id = :sid"


def _prepared_after_repeats(settings: Settings) -> tuple[object, int]:
    engine = make_engine(settings, pool_size=1)
    try:
        with engine.connect() as conn:
            for _ in range(10):
                conn.execute(text(_QUERY), {"sid": "prepared-probe"})
            threshold = conn.connection.dbapi_connection.prepare_threshold  # type: ignore[union-attr]
            prepared = conn.execute(
                text(
                    "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%prepared-probe%'"
                    " OR statement LIKE '%FROM runs WHERE session_id = $1%'"
                )
            ).scalar_one()
        return threshold, int(prepared)
    finally:
        engine.dispose()


def test_a_repeated_statement_is_prepared_on_the_server_by_default(settings: Settings) -> None:
    threshold, prepared = _prepared_after_repeats(settings)

    assert threshold is not None
    assert prepared == 1


def test_prepared_statements_can_be_turned_off_for_pgbouncer_in_transaction_mode(settings: Settings) -> None:
    threshold, prepared = _prepared_after_repeats(settings.model_copy(update={"database_prepared_statements": False}))

    assert threshold is None
    assert prepared == 0


def test_the_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOUSHO_DATABASE_PREPARED_STATEMENTS", "false")

    assert Settings().database_prepared_statements is False
