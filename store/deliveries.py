"""Webhook deliveries in Postgres: one row per (agent, delivery id), written with its run in one transaction.

Owns the delivery id → run id mapping and the atomic intake (delivery row, for GitHub the body-hash row,
run row, first inbox entry). It must not verify signatures, parse HTTP or publish messages: callers do
that around it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from sqlalchemy import Engine, text
from sqlalchemy.engine import Connection

from store import errors, records, runs
from store.database import Transaction
from store.records import Delivery, Intake

__all__ = ["MAX_DELIVERY_ID", "PREFIX", "PostgresDeliveryStore", "check_delivery_id", "session_id_for"]

#: Run ids of webhook runs start with this.
PREFIX = "job-"
MAX_DELIVERY_ID = 256
_READABLE_AGENT = re.compile(r"[A-Za-z0-9_]{1,64}")
# No dot: forks (``<run>.fork-<n>``), child tasks (``<run>.task-…``) and the reserved keys of a run
# (``.turn-<n>``, ``.paused``, ``.fire``) all add a dot to a run id, so a run id without one is none of them.
_READABLE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_PRINTABLE = re.compile(r"[\x21-\x7e]+")

_COLUMNS = "agent, delivery_id, session_id, source, body_sha256, received_at"
_CLAIM = text(f"""
INSERT INTO deliveries (agent, delivery_id, session_id, source, body_sha256)
VALUES (:agent, :delivery_id, :sid, :source, :sha)
ON CONFLICT (agent, delivery_id) DO NOTHING
RETURNING {_COLUMNS}
""")
_GET = text(f"SELECT {_COLUMNS} FROM deliveries WHERE agent = :agent AND delivery_id = :delivery_id")
# GitHub signs the body only: a body seen before for the agent is a replay, whatever its delivery id.
_CLAIM_BODY = text("""
INSERT INTO delivery_bodies (agent, body_sha256, delivery_id) VALUES (:agent, :sha, :delivery_id)
ON CONFLICT (agent, body_sha256) DO NOTHING RETURNING delivery_id
""")
_GET_BODY = text("SELECT delivery_id, received_at FROM delivery_bodies WHERE agent = :agent AND body_sha256 = :sha")


class _Replay(Exception):
    """Internal: rolls back the intake of a GitHub body seen before under another delivery id."""

    def __init__(self, original: Delivery) -> None:
        super().__init__(original.delivery_id)
        self.original = original


def check_delivery_id(delivery_id: str) -> str:
    """Return ``delivery_id`` when it can key a delivery: 1-256 printable ASCII characters.

    Raises:
        ConfigurationError: empty, too long, or with spaces or control characters.
    """
    if not isinstance(delivery_id, str) or len(delivery_id) > MAX_DELIVERY_ID or not _PRINTABLE.fullmatch(delivery_id):
        raise errors.ConfigurationError("a delivery id must be 1-256 printable ASCII characters")
    return delivery_id


def session_id_for(agent: str, delivery_id: str) -> str:
    """The run id of a delivery: ``job-<agent>-<id>`` when both are plain, else ``job-h<hash>``.

    Plain means letters, digits and ``_`` for the agent (so the first ``-`` after the prefix splits
    the two parts) and letters, digits, ``_`` and ``-`` for the id; the hashed form has no ``-``
    after the prefix. So two different (agent, delivery id) pairs never share a run id, and as
    neither form has a dot, no delivery can name a fork, a child task or a reserved key of a run.
    Plain ids map as in earlier releases; a delivery accepted before keeps the run id stored in
    its row whatever this function says now.

    Raises:
        ConfigurationError: the delivery id is not 1-256 printable ASCII characters.
    """
    check_delivery_id(delivery_id)
    if _READABLE_AGENT.fullmatch(agent) and _READABLE_ID.fullmatch(delivery_id):
        return records.validate_session_id(f"{PREFIX}{agent}-{delivery_id}")
    digest = hashlib.sha256(f"{agent}\x00{delivery_id}".encode()).hexdigest()[:40]
    return f"{PREFIX}h{digest}"


def _original(conn: Connection, params: dict[str, str]) -> Delivery:
    """The delivery that first brought a body (committed, so visible to this transaction's next statement)."""
    body = conn.execute(_GET_BODY, params).one()
    row = conn.execute(_GET, {**params, "delivery_id": body.delivery_id}).first()
    if row is not None:
        return Delivery.model_validate(dict(row._mapping))
    # Its delivery row was removed by hand: the body still stands for it.
    return Delivery(
        agent=params["agent"],
        delivery_id=body.delivery_id,
        session_id=session_id_for(params["agent"], body.delivery_id),
        source="github",
        body_sha256=params["sha"],
        received_at=body.received_at,
    )


class PostgresDeliveryStore:
    """Deliveries keyed by (agent, delivery id); a delivery starts its run exactly once."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def record(
        self,
        agent: str,
        delivery_id: str,
        source: records.DeliverySource,
        body_sha256: str,
        messages: Sequence[records.Message],
        fairness_key: str | None = None,
    ) -> Intake:
        """Record a verified delivery and start its run, all in one transaction.

        Concurrent copies of one delivery wait on the unique key: exactly one creates the run,
        the others get the existing row back (``created=False``) and write nothing. A GitHub
        delivery whose body the agent accepted before under another delivery id writes nothing
        and returns that earlier delivery with ``replay_of`` set (GitHub signs the body only, so
        a captured delivery could otherwise be replayed under fresh ids). ``fairness_key`` (checked already)
        becomes the run's with its input.

        Raises:
            ConfigurationError: the delivery id is malformed, or its run id belongs to another agent.
            SessionAwaitingApprovalError: the run id is taken by a run paused on an approval.
            CheckpointCorruptError: the run id is taken by a run whose checkpoint cannot be read.
            CheckpointFormatError: the run id is taken by a run in a checkpoint format this release cannot read.
            StorageError: the database failed; nothing was written.
        """
        session_id = session_id_for(agent, delivery_id)
        params = {"agent": agent, "delivery_id": delivery_id, "sid": session_id, "source": source, "sha": body_sha256}
        try:
            with Transaction(self.engine) as conn:
                row = conn.execute(_CLAIM, params).first()
                if row is None:
                    existing = conn.execute(_GET, params).one()
                    return Intake(Delivery.model_validate(dict(existing._mapping)), created=False)
                if source == "github" and conn.execute(_CLAIM_BODY, params).first() is None:
                    raise _Replay(_original(conn, params))
                # The run is almost always new: one insert; a run made by hand under the id gets the input queued.
                if not runs.create_run(conn, session_id, agent, messages, fairness_key=fairness_key):
                    runs.queue_input(conn, session_id, agent, messages, fairness_key=fairness_key)
        except _Replay as replay:
            return Intake(replay.original, created=False, replay_of=replay.original.delivery_id)
        return Intake(Delivery.model_validate(dict(row._mapping)), created=True)

    def get(self, agent: str, delivery_id: str) -> Delivery | None:
        """The recorded delivery, or None."""
        with Transaction(self.engine) as conn:
            row = conn.execute(_GET, {"agent": agent, "delivery_id": delivery_id}).first()
        return None if row is None else Delivery.model_validate(dict(row._mapping))
