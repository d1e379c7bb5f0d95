"""Alembic migrations of the Lousho schema (``lousho migrate`` applies them)."""
