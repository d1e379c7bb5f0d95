"""The recovery sweep's report to agents: ``on_recovered`` and ``on_error`` for the runs it sent on, once each.

The sweep (``worker.tasks.recover``) sends a step for a run that stopped moving and marks it recovering
(``store.checkpoints``: ``mark_swept``), as a worker's main process does for a run whose process died
(``worker.orphans``). Each later pass asks the store which of those runs came out since, for
the agents this worker loads, and clears their marks in the same statement, so no other sweep reports them again;
then it calls the agent's callbacks. At most once per recovery: a worker that dies between the two loses that
report. Runs of agents this worker does not load wait for a sweep on a worker that does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from store import interfaces
from worker.agents import Agent

__all__ = ["REPORT_LIMIT", "report"]

log = logging.getLogger("lousho.recovery")

#: Recoveries reported per pass at most; the rest are reported at the next pass.
REPORT_LIMIT = 500


def report(store: interfaces.RecoveryStore, agents: Mapping[str, Agent], limit: int = REPORT_LIMIT) -> int:
    """Tell each agent about the runs the sweep sent on that came out since; how many were reported.

    A callback that raises is logged and the pass goes on (the report is not made again).

    Raises:
        StorageError: the store could not be read (nothing was reported; the next pass tries again).
    """
    settled = store.settle_recoveries(sorted(agents), limit)
    for run in settled:
        agent = agents[run.agent]
        what = "on_recovered" if run.last_error is None else "on_error"
        try:
            if run.last_error is None and agent.on_recovered is not None:
                agent.on_recovered(run)
            elif run.last_error is not None and agent.on_error is not None:
                agent.on_error(run.last_error, run)
        except Exception as exc:  # the application's code must never stop the sweep: logged, not retried
            log.warning("%s of agent %s failed for %s: %s", what, run.agent, run.session_id, type(exc).__name__)
    if settled:
        log.info("recover: %d recovery report(s) made", len(settled))
    return len(settled)
