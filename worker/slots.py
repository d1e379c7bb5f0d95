"""A step's model call under its agent's ``ModelLimit``: a slot taken or a wait that holds no worker process.

A run that must wait is not a failure: its step ends at once with ``Outcome.WAITING`` (its claim's attempt taken
back, no retry budget spent), and either a countdown of a few seconds brings it back (a rate or cool-down wait) or
the holder that frees a slot wakes it (a slot wait; the sweep's wake pass when a holder died). While the call
runs, ``SlotKeeper`` renews the slot, so a dead holder frees it within one lease TTL. Framework-free; the state
is ``store.model_slots``'s.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from store import errors, interfaces, model_limit, telemetry
from store.model_limit import ModelLimit, SlotAnswer
from store.records import Checkpoint
from worker.agents import Agent, reachable

__all__ = [
    "COOL_DOWN_STATUSES",
    "Held",
    "SlotKeeper",
    "cool_down_of",
    "fairness_of",
    "limit_of",
    "noted",
    "settled_limits",
    "wait_countdown",
    "woken_names",
]

log = logging.getLogger("lousho.limits")

#: Provider answers that cool a whole limit key down when they carry ``Retry-After``: rate limited, overloaded.
COOL_DOWN_STATUSES = (429, 529)


@dataclass(frozen=True)
class Held:
    """A slot a step holds for one model call."""

    limit: ModelLimit
    session_id: str


def limit_of(agent: Agent, environment: dict[str, ModelLimit]) -> ModelLimit | None:
    """The limit ``agent``'s model calls go under: its key's numbers from ``LOUSHO_MODEL_LIMITS`` when set there."""
    own = agent.model_limit
    if own is None:
        return None
    return environment.get(own.key, own)


def settled_limits(agents: Iterable[Agent], environment: dict[str, ModelLimit]) -> dict[str, ModelLimit]:
    """The limit each key holds in this worker (``model_limit.settle``): its agents', handoffs' and sub-agents'.

    Raises:
        ConfigurationError: two agents give one key different numbers and ``LOUSHO_MODEL_LIMITS`` does not settle it.
    """
    named = [(agent.name, agent.model_limit) for agent in reachable(agents) if agent.model_limit is not None]
    return model_limit.settle(sorted(named, key=lambda pair: pair[0]), environment)


def wait_countdown(answer: SlotAnswer, cap_s: float) -> float | None:
    """Seconds until the step looks again, None when a wake-up brings it back (a slot wait).

    Timed waits longer than ``cap_s`` come back at ``cap_s`` and wait again (RELIABILITY P1: no long countdown); a
    little jitter keeps the callers of one key from coming back all at once.
    """
    if answer.reason == "slot":
        return None
    return min(cap_s, max(0.05, answer.wait_s)) + random.uniform(0, 0.25)


def woken_names(woken: tuple[tuple[str, str], ...]) -> list[tuple[str, str | None]]:
    """Runs a freed slot went to, with the queue their step goes to (the shared one when the agent is unknown)."""
    return [(sid, agent or None) for sid, agent in woken]


class SlotKeeper:
    """One daemon thread per process renewing the slots its model calls hold, every third of the slot TTL."""

    def __init__(self, slots: interfaces.ModelSlots) -> None:
        self._slots = slots
        self._held: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pid = 0

    def hold(self, held: Held) -> None:
        """Keep ``held`` renewed until ``drop``."""
        with self._lock:
            slot = (held.limit.key, held.session_id)
            self._held[slot] = self._held.get(slot, 0) + 1
            if self._pid != os.getpid():
                # A forked child inherits the object but not the thread: start one of its own.
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="lousho-model-slots", daemon=True).start()

    def drop(self, held: Held) -> None:
        """Stop renewing ``held``."""
        with self._lock:
            slot = (held.limit.key, held.session_id)
            left = self._held.get(slot, 0) - 1
            if left > 0:
                self._held[slot] = left
            else:
                self._held.pop(slot, None)

    def _run(self) -> None:
        interval = max(0.05, self._slots.ttl_ms / 3000)
        while not self._wake.wait(interval):
            with self._lock:
                by_key: dict[str, list[str]] = {}
                for key, sid in self._held:
                    by_key.setdefault(key, []).append(sid)
            for key, sids in by_key.items():
                try:
                    self._slots.renew(key, sids)
                except errors.StorageError:
                    # Renewal failing lets the slot expire: the limit may be exceeded for one TTL (I20).
                    log.warning("could not renew the model slots of %s", key)


def cool_down_of(exc: BaseException) -> float | None:
    """The seconds a provider's answer asks every caller of the key to wait (429/529 with ``Retry-After``)."""
    if isinstance(exc, errors.ProviderError) and exc.status in COOL_DOWN_STATUSES and exc.retry_after:
        return float(exc.retry_after)
    return None


def fairness_of(checkpoint: Checkpoint, weights: dict[str, int]) -> tuple[str | None, int]:
    """The run's fairness key and its weight (``LOUSHO_FAIRNESS_WEIGHTS``; 1 when unnamed)."""
    key = checkpoint.fairness_key
    return key, weights.get(key, 1) if key is not None else 1


def noted(limit: ModelLimit, answer: SlotAnswer) -> None:
    """Tell the step's report why it waits (the metrics count waits by reason)."""
    telemetry.note(waited=answer.reason, limit_key=limit.key)
