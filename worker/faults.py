"""Crash points for the crash tests; defined in ``store.faults`` so producers can use them too."""

from __future__ import annotations

from store.faults import crash_point

__all__ = ["crash_point"]
