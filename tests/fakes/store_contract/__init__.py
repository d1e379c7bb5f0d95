"""The checkpoint store contract: checks every implementation of ``store.interfaces.CheckpointStore`` (and of
``ApprovalStore`` over the same data) must pass, given a factory.

The unit tier runs them against ``store.memory.MemoryCheckpointStore``; the integration tier runs the same
functions against ``PostgresCheckpointStore``, with a factory over an empty database:
``StoreSubject(store, PostgresApprovalStore(engine), now=<Postgres now()>, tick=lambda: time.sleep(0.01),
corrupt=<an UPDATE of runs.document>)``, and ``@pytest.mark.parametrize("check", CHECKS)``. Each check owns the
run ids it creates.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.fakes.store_contract import approvals, events, listing, maintenance, runs, steps
from tests.fakes.store_contract.subject import AGENT, StoreFactory, StoreSubject

CHECKS: tuple[Callable[[StoreFactory], None], ...] = (
    *steps.CHECKS,
    *runs.CHECKS,
    *maintenance.CHECKS,
    *approvals.CHECKS,
    *events.CHECKS,
    *listing.CHECKS,
)

__all__ = ["AGENT", "CHECKS", "StoreFactory", "StoreSubject"]
