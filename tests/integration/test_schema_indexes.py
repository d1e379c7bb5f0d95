"""The indexes a migrated database has are the ones ``store/schema.py`` declares: a migration that adds or drops
one without the schema module (or the other way round) is caught here. Real Postgres at Alembic's head."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from alembic import command
from sqlalchemy import Engine, text

from store.checkpoints import PostgresCheckpointStore
from store.database import alembic_config, make_engine, migrate
from store.schema import metadata
from store.settings import Settings
from tests.support import services

# Indexes that back a primary key or a unique constraint are the constraints' own, not declared as indexes.
_INDEXES = text("""
SELECT i.tablename, i.indexname FROM pg_indexes i
WHERE i.schemaname = current_schema() AND i.tablename = ANY(:tables)
  AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname AND c.contype IN ('p', 'u'))
""")


def _indexes(engine: Engine) -> set[tuple[str, str]]:
    with engine.connect() as conn:
        return {(row.tablename, row.indexname) for row in conn.execute(_INDEXES, {"tables": list(metadata.tables)})}


def test_the_migrated_indexes_are_the_declared_ones(store: PostgresCheckpointStore) -> None:
    declared = {(table.name, index.name) for table in metadata.tables.values() for index in table.indexes}
    present = _indexes(store.engine)
    assert sorted(present - declared) == [], "indexes the migrations made that store/schema.py does not declare"
    assert sorted(declared - present) == [], "indexes store/schema.py declares that the migrations do not make"
    assert ("runs", "runs_movable_idx") not in present  # no query reads it since revision 0021 (dropped in 0023)


@pytest.fixture
def own_settings(settings: Settings) -> Iterator[Settings]:
    """A database of its own, empty."""
    name = f"{services.TEST_DATABASE}_indexes"
    yield services.own_database(settings, name)
    services.drop_database(name)


def test_the_downgrade_from_0023_builds_the_movable_index_again_and_the_upgrade_drops_it(
    own_settings: Settings,
) -> None:
    migrate(own_settings)
    engine = make_engine(own_settings)
    try:
        command.downgrade(alembic_config(own_settings), "0022")
        assert ("runs", "runs_movable_idx") in _indexes(engine)
        migrate(own_settings)
        assert ("runs", "runs_movable_idx") not in _indexes(engine)
    finally:
        engine.dispose()
