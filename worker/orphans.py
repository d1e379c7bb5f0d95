"""Steps whose process died on this host: their leases released and the steps sent again at once.

A run whose pool process died mid-step would otherwise wait for Celery to notice (its pool checks every few
seconds, then requeues the message) or, when the whole worker died, for the dead process's lease to run out
(``LOUSHO_LEASE_TTL_MS``) and then for a sweep. The worker's main process calls ``DeadSteps.check`` on the step
messages it holds and its pool's processes (``worker.tasks`` reads them from Celery and ``/proc``) and
``resend_at_start`` when it starts.
Only a lease whose holder is provably gone is released (``store.owners``): a live holder, or one on another
host, keeps its lease until its TTL. Imports no Celery; a duplicate of a step sent here is harmless (a step
finds its run busy or its seq stale).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from store import errors, interfaces, owners, records

__all__ = ["DeadSteps", "PoolStep", "resend_at_start"]

log = logging.getLogger("lousho.orphans")

#: Pages of due runs the pass at start reads at most (``SWEEP_LIMIT`` runs each); the sweep covers the rest.
START_PAGES = 20
#: How long a step stays among the checked ones after it was last received or listed (Celery may drop a dead
#: process's request before a check lists it), and how many are kept that long at most.
KEPT_S = 5.0
KEPT_MAX = 5000


@dataclass(frozen=True)
class PoolStep:
    """A step message this worker holds: task id, pool process (None until one took it), run, where it came from.

    The step is sent again without the message's seq: the dead process may have saved before it died (the seq moved
    on, and a copy with the old one would be dropped as stale), and no one else works on the run once its lease is
    released.
    """

    task_id: str
    pid: int | None
    session_id: str
    #: The queue the message came from (None: the agent's queue, as the sender would choose it).
    queue: str | None = None
    #: The name the step was sent under (Flower's task name).
    name: str | None = None


class DeadSteps:
    """Notices pool processes that died mid-step and sends their steps again, once per message."""

    def __init__(
        self, leases: interfaces.Leases, send: Callable[[PoolStep], None], store: interfaces.RecoveryStore | None = None
    ) -> None:
        self._leases = leases
        self._send = send
        #: Where the runs sent again are marked swept (and recovering: the sweep reports how they came out).
        self._store = store
        self._handled: set[str] = set()
        #: Steps received or listed in the last ``KEPT_S``, oldest first: task id -> (when, step).
        self._recent: dict[str, tuple[float, PoolStep]] = {}
        self._recent_lock = threading.Lock()
        #: The pool's processes running at the last check (None before the first).
        self._children: set[int] | None = None

    def received(self, step: PoolStep) -> None:
        """Keep ``step`` (a message the worker just received) among the checked ones for ``KEPT_S``.

        Called from the consumer's thread for every step message: constant work, the oldest entries dropped.
        """
        self._keep([step], time.monotonic())

    def _keep(self, steps: Iterable[PoolStep], now: float) -> None:
        with self._recent_lock:
            for step in steps:
                self._recent.pop(step.task_id, None)  # to the end: the entries stay in time order
                self._recent[step.task_id] = (now, step)
            horizon = now - KEPT_S
            while self._recent:
                oldest = next(iter(self._recent))
                if self._recent[oldest][0] >= horizon and len(self._recent) <= KEPT_MAX:
                    break
                del self._recent[oldest]

    def check(self, steps: Iterable[PoolStep], children: Iterable[int] | None = None) -> list[str]:
        """When a pool process died, release the leases it held among ``steps`` and send those steps again.

        A death is a step's process that no longer runs, or a change in ``children`` (the pool's processes, when the
        caller can list them): one that ran at the last check no longer does, or a new one replaced it. A process
        can die before its parent learnt which step it took, and be replaced before a check sees it dead. The first
        check counts as one (the watch starts after the pool). Then every step listed now, or received or listed in
        the last ``KEPT_S``, whose lease a gone process holds is sent again (Celery may drop a dead process's
        request before a check lists it). Returns the runs sent again. A message is sent again once (its task id is
        kept while it is listed); a run whose lease a live process holds (a redelivered copy got there first) is not
        sent. The runs sent are marked swept, as the sweep marks the runs it sends (best effort: a store that cannot
        be reached only costs the report of that recovery).

        Raises:
            StorageError: the leases could not be read or released (the next check tries again).
        """
        current = list(steps)
        self._keep(current, time.monotonic())
        with self._recent_lock:
            listed = [step for _, step in self._recent.values()]
        if self._handled:
            self._handled &= {step.task_id for step in listed}
        running = {pid for pid in (children or ()) if owners.is_running(pid)}
        died = self._children is None or self._children != running
        if not died:
            # One /proc read per distinct pid, not per listed step (a pid in ``running`` was just read).
            died = any(not owners.is_running(pid) for pid in {s.pid for s in listed if s.pid is not None} - running)
        self._children = running
        if not died:
            return []
        candidates = [step for step in listed if step.task_id not in self._handled]
        if not candidates:
            return []
        freed = set(self._leases.release_gone(sorted({step.session_id for step in candidates})))
        sent = []
        for step in candidates:
            if step.session_id in freed and step.session_id not in sent:
                self._handled.add(step.task_id)
                log.info("step of %s sent again: the pool process running it died", step.session_id)
                self._send(step)
                sent.append(step.session_id)
        if sent and self._store is not None:
            try:
                self._store.mark_swept(sent)
            except errors.StorageError as exc:
                log.warning("could not mark the runs sent again as recovering (%s)", exc.code)
        return sent


def resend_at_start(
    store: interfaces.RecoveryStore,
    leases: interfaces.Leases,
    send: Callable[[records.DueRun], None],
    page_size: int,
    deadline_s: float = 30.0,
) -> int:
    """Send a step for each run whose lease a dead process of this host holds (a worker killed whole, restarted).

    Reads the runs that could move, ``page_size`` at a time (``START_PAGES`` pages or ``deadline_s`` at most),
    releases the leases whose holder is gone and sends those runs a step; they are marked swept, so the sweep
    does not send them again for a lease TTL. Returns how many were sent.

    Raises:
        StorageError: Postgres could not be read (the sweep recovers the runs later).
        StorageError: the leases could not be read or released.
    """
    stop = time.monotonic() + deadline_s
    sent, after = 0, None
    for _ in range(START_PAGES):
        page = store.due_runs(0.0, page_size, after)
        if not page:
            break
        after = page[-1]
        valid = [run for run in page if _valid(run.session_id)]
        freed = set(leases.release_gone([run.session_id for run in valid]))
        resent = [run for run in valid if run.session_id in freed]
        for run in resent:
            send(run)
        store.mark_swept([run.session_id for run in resent])
        sent += len(resent)
        if len(page) < page_size or time.monotonic() > stop:
            break
    if sent:
        log.info("start: %d run(s) held by dead processes of this host sent again", sent)
    return sent


def _valid(session_id: str) -> bool:
    try:
        records.validate_session_id(session_id)
    except errors.SessionIdInvalidError:
        return False
    return True
