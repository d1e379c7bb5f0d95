"""Schedules from the producer side: ``client.schedules`` (create/list/pause/resume/delete/fires).

Owns argument checking (the command line is ``producer.cli.schedules``). It must not fire ticks: the beat sweep in
``worker.schedules`` does; the records are ``store.schedule_records``, the tick arithmetic ``store.ticks``.
"""

from __future__ import annotations

import builtins
from datetime import timedelta
from typing import Protocol

from sqlalchemy import Engine

from store import inputs
from store.schedule_records import CatchUp, Fire, Overlap, Schedule, build_spec
from store.schedules import PostgresScheduleStore


class Producer(Protocol):
    """What schedules need of ``producer.client.Client`` (typed here so neither module imports the other)."""

    @property
    def engine(self) -> Engine:
        """The SQL engine of the client's Postgres stores."""

    def known_agents(self) -> list[str]:
        """Agents registered by workers."""


class Schedules:
    """Schedules stored in Postgres; every beat fires each of their ticks once."""

    def __init__(self, client: Producer) -> None:
        self._client = client
        self._store = PostgresScheduleStore(client.engine)

    def create(
        self,
        name: str,
        agent: str,
        input: inputs.Input,
        *,
        cron: str | None = None,
        every: float | timedelta | None = None,
        timezone: str = "UTC",
        overlap: Overlap = "skip",
        catch_up: CatchUp = "one",
        check_agent: bool = True,
    ) -> Schedule:
        """Store a schedule that sends ``input`` to a new run of ``agent`` at each tick.

        Give ``cron`` (5 fields or a ``@daily``-style macro, read in ``timezone``, DST-aware) or
        ``every`` (whole seconds or a ``timedelta``, 1 s to 10 years; ticks aligned on the Unix epoch). Each tick's
        run is ``sched-<schedule_id>-<UTC time>``. ``overlap="skip"`` claims a tick without a run
        while the previous run is active (not while it is parked on a non-retryable error);
        ``catch_up="one"`` fires one run for ticks missed during downtime (older than the sweep's
        grace), ``"skip"`` drops them.

        Raises:
            ConfigurationError: an invalid field (its ``field`` names it: an unknown time zone, a cron
                expression that does not parse, ``every`` outside 1 s to 10 years), both or neither of
                cron/every, or the name is taken.
            InputTooLargeError: the input is too large or too deep.
            AgentNotFoundError: workers registered agents and this name is not among them.
        """
        messages = inputs.normalize_input(input)
        if check_agent:
            inputs.check_agent(agent, self._client.known_agents())
        spec = build_spec(
            name, agent, messages, cron=cron, every=every, timezone=timezone, overlap=overlap, catch_up=catch_up
        )
        return self._store.create(spec)

    def list(self) -> builtins.list[Schedule]:
        """Every schedule, by name; a broken one has ``broken_error`` and ``broken_at`` set."""
        return self._store.list()

    def get(self, name: str) -> Schedule:
        """One schedule.

        Raises:
            ScheduleNotFoundError: no schedule has that name.
        """
        return self._store.get(name)

    def pause(self, name: str) -> Schedule:
        """Stop firing until ``resume``.

        Raises:
            ScheduleNotFoundError: no schedule has that name.
        """
        return self._store.pause(name)

    def resume(self, name: str) -> Schedule:
        """Fire again from the next tick after now; ticks of the pause are not fired.

        Also tries a broken schedule again (once the workers can compute its ticks): it stays
        broken, with the new error, when its ticks still cannot be computed here.

        Raises:
            ScheduleNotFoundError: no schedule has that name.
        """
        return self._store.resume(name)

    def delete(self, name: str) -> bool:
        """Drop the schedule (its runs stay); False when there is none of that name."""
        return self._store.delete(name)

    def fires(self, name: str, limit: int = 20) -> builtins.list[Fire]:
        """The schedule's claimed ticks, newest first."""
        return self._store.fires(name, limit)
