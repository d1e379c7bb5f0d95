"""A heartbeat that never renews: leases then expire exactly when the fake clock says so."""

from __future__ import annotations

from store.records import Lease


class NullHeartbeat:
    """A ``store.interfaces.Heartbeat`` that renews nothing; remembers which leases a step held."""

    def __init__(self) -> None:
        self.holding: dict[str, Lease] = {}
        self.held_ever: list[Lease] = []

    def hold(self, lease: Lease) -> None:
        self.holding[lease.owner] = lease
        self.held_ever.append(lease)

    def drop(self, lease: Lease) -> None:
        self.holding.pop(lease.owner, None)

    def stop(self) -> None:
        self.holding.clear()
