"""``Backend``: the stores, the publisher, the lease reader and the client the routes use, built once per process.

Owns publishing ``advance`` after a commit (a broker failure is left to the recover sweep); it must not
write runs itself: that is ``store.deliveries``, ``store.approvals`` and the client (events, abort, steer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from store import errors, interfaces
from store.approvals import PostgresApprovalStore
from store.deliveries import PostgresDeliveryStore
from store.settings import Settings

if TYPE_CHECKING:
    from producer.client import Client

log = logging.getLogger("lousho.webhooks")

#: What a publish can fail with once the broker is unreachable (kombu wraps the transport's errors).
_BROKER_ERRORS = (errors.StorageError, OSError)


@dataclass
class Backend:
    """What the routes use: the stores, the publisher, the lease reader, the client; built once per process.

    ``client`` serves a run's events, abort and steer; a backend without one answers those routes 501.
    """

    deliveries: PostgresDeliveryStore
    checkpoints: interfaces.ProducerStore
    approvals: PostgresApprovalStore
    #: ``enqueue(session_id, agent=…)``: send ``advance`` to that agent's queue.
    enqueue: Callable[..., None]
    lease_holder: Callable[[str], str | None]
    known_agents: Callable[[], list[str]]
    close: Callable[[], None] = lambda: None
    client: Client | None = None

    @classmethod
    def from_client(cls, client: Client) -> Backend:
        """A backend on a producer client's engine, broker connection and Redis."""
        engine = client.engine
        return cls(
            deliveries=PostgresDeliveryStore(engine),
            checkpoints=client.store,
            approvals=PostgresApprovalStore(engine),
            enqueue=client.enqueuer.advance,
            lease_holder=client.leases.holder,
            known_agents=client.known_agents,
            close=client.close,
            client=client,
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> Backend:
        """A backend with a client and a connection pool of its own; ``close`` releases both."""
        from producer.client import Client
        from store.database import make_engine

        engine = make_engine(settings, pool_size=8)
        client = Client(settings, engine=engine)
        backend = cls.from_client(client)

        def close() -> None:
            client.close()
            engine.dispose()

        backend.close = close
        return backend

    def publish(self, session_id: str, agent: str) -> None:
        """Send ``advance`` for a run whose input is committed; a broker failure is left to the recover sweep.

        The commit is what makes the delivery durable, so the sender must get its 2xx: answering an error
        would only make it deliver again.
        """
        try:
            self.enqueue(session_id, agent=agent)
        except _BROKER_ERRORS as exc:
            log.warning(
                "run %s is committed but its step could not be published (%s); the recover sweep will send it",
                session_id,
                type(exc).__name__,
            )
