"""A heartbeat that renews only when told to: a test chooses the moment a running step hears its run's signals."""

from __future__ import annotations

from store import interfaces
from store.records import Lease


class ManualHeartbeat:
    """A ``store.interfaces.Heartbeat`` whose ``beat`` renews every held lease (and hears abort and steer signals).

    The real heartbeat renews on a timer, so whether a step hears an abort before its next call depends on the
    clock; here it hears it exactly when the test beats.
    """

    def __init__(self, leases: interfaces.Leases) -> None:
        self._leases = leases
        self.holding: dict[str, Lease] = {}

    def hold(self, lease: Lease) -> None:
        self.holding[lease.owner] = lease

    def drop(self, lease: Lease) -> None:
        self.holding.pop(lease.owner, None)

    def stop(self) -> None:
        self.holding.clear()

    def beat(self) -> None:
        """Renew every held lease now, as one tick of the real heartbeat would."""
        for lease in list(self.holding.values()):
            self._leases.renew(lease)
