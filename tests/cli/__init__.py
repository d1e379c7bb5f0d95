"""Tests of the ``lousho`` command, one module per command group."""

from __future__ import annotations
