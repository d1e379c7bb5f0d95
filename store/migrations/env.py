"""Alembic environment: migrations run against the URL the caller put on the config."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from store.schema import metadata

config = context.config
url = config.get_main_option("sqlalchemy.url")
if not url:
    raise RuntimeError("set sqlalchemy.url on the Alembic config (lousho migrate does)")

engine = create_engine(url, hide_parameters=True)
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=metadata)
    with context.begin_transaction():
        # One migrator at a time, whatever the number of processes starting together.
        connection.exec_driver_sql("SELECT pg_advisory_xact_lock(7170681)")
        context.run_migrations()
engine.dispose()
