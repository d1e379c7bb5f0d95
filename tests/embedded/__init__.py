"""Tests that start the embedded Postgres and Redis of ``devkit.embedded`` in a temporary folder."""

from __future__ import annotations
