"""Testing agents without services: ``run_local`` and ``replay``, in this process, on the in-memory stores.

``run_local`` runs an agent on the real step machine; ``replay`` runs a recorded run's inputs, decisions and tool
results through an agent and says where its turns diverge.

Needs no Postgres, Redis or Celery, and imports nothing of ``producer``. A pytest fixture, ``lousho_local``, comes
with the package (``worker.testing.fixtures``, a pytest plugin registered when Lousho is installed).
"""

from __future__ import annotations

from worker.testing.local import Decide, LocalRuntime, run_local
from worker.testing.replays import ReplayReport, TurnDiff, replay

__all__ = ["Decide", "LocalRuntime", "ReplayReport", "TurnDiff", "replay", "run_local"]
