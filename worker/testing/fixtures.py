"""The ``lousho_local`` pytest fixture: ``run_local`` on a fresh in-memory runtime per test.

A pytest plugin, loaded wherever Lousho is installed (the ``pytest11`` entry point ``lousho``)::

    def test_checkout(lousho_local):
        result = lousho_local.run(shop, "Charge order 7", decide=lambda approval: True)
        assert result.finish_reason == "stop"
        assert [e.type for e in lousho_local.events()][-1] == "run.done"
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from store.events import Event
from store.inputs import Input
from store.summaries import RunResult
from worker.agents import Agent
from worker.testing.local import Decide, LocalRuntime, run_local

__all__ = ["LocalRunner", "lousho_local"]


class LocalRunner:
    """Runs agents in the test's process; keeps the runtime of the last ``run`` to read its runs and events."""

    def __init__(self) -> None:
        self.runtime: LocalRuntime | None = None
        self.session_id = ""

    def run(
        self,
        agent: Agent,
        input: Input,
        *,
        session_id: str = "local-1",
        decide: Decide | None = None,
        crash_at: str | Iterable[str] | None = None,
        **options: Any,
    ) -> RunResult:
        """``run_local`` with its runtime kept for ``events``; a second ``run`` of a session sends it more input.

        A run of another agent (or another agent of the same name) gets a new runtime.
        """
        if self.runtime is None or self.runtime.agents.get(agent.name) is not agent:
            self.runtime = LocalRuntime.serving([agent])
        self.session_id = session_id
        return run_local(
            agent, input, session_id=session_id, decide=decide, crash_at=crash_at, runtime=self.runtime, **options
        )

    def events(self, session_id: str | None = None) -> list[Event]:
        """The durable events of the last run (or of ``session_id``), in order."""
        assert self.runtime is not None, "nothing ran yet"
        return list(self.runtime.events(session_id or self.session_id))


@pytest.fixture
def lousho_local() -> Iterator[LocalRunner]:
    """A runner of agents on the real step machine, in memory, for one test."""
    yield LocalRunner()
