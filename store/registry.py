"""Which live worker serves which agent: registrations written at worker start and refreshed while it runs.

During a rolling deploy, workers of two releases consume the same queues. A step that reaches a
worker lacking its agent, a tool or the checkpoint's format asks this registry whether a live
worker has them, and hands the run back instead of parking it. Times are Postgres's ``now()``.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.engine import Connection

from store import payloads
from store.database import Transaction
from store.model_limit import LimitConflict, ModelLimit, conflicts
from store.records import Serving

__all__ = ["PostgresAgentRegistry"]

_REGISTER = text("""
INSERT INTO agent_workers (agent, worker_id, fingerprint, formats, model_limit, seen_at)
VALUES (:agent, :worker, CAST(:fingerprint AS jsonb), CAST(:formats AS jsonb), CAST(:limit AS jsonb), now())
ON CONFLICT (agent, worker_id) DO UPDATE
SET fingerprint = EXCLUDED.fingerprint, formats = EXCLUDED.formats, model_limit = EXCLUDED.model_limit,
    seen_at = now()
""")
_LIMITS = text("""
SELECT DISTINCT worker_id, model_limit FROM agent_workers
WHERE model_limit IS NOT NULL AND seen_at > now() - make_interval(secs => :within)
""")
_NAMES = text("""
INSERT INTO agents (name, fingerprint, seen_at) VALUES (:agent, CAST(:fingerprint AS jsonb), now())
ON CONFLICT (name) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, seen_at = now()
""")
_KNOWN_NAMES = text("SELECT name FROM agents ORDER BY name")
_REFRESH = text("UPDATE agent_workers SET seen_at = now() WHERE worker_id = :worker")
_FORGET = text("DELETE FROM agent_workers WHERE worker_id = :worker")
# Registrations of workers gone for a day are dropped by whoever registers next.
_EXPIRE = text("DELETE FROM agent_workers WHERE seen_at < now() - interval '1 day'")
_LIVE_AGENTS = text("SELECT DISTINCT agent FROM agent_workers WHERE seen_at > now() - make_interval(secs => :within)")
_BEHIND = text("""
SELECT DISTINCT worker_id FROM agent_workers
WHERE seen_at > now() - make_interval(secs => :within) AND NOT formats @> CAST(:format AS jsonb)
ORDER BY worker_id
""")
# The seconds since a run was created (its first input), when no worker ever registered the agent it names.
_UNREGISTERED_FOR = text("""
SELECT extract(epoch FROM now() - r.created_at) AS waited_s FROM runs r
WHERE r.session_id = :sid AND NOT EXISTS (SELECT 1 FROM agents a WHERE a.name = :agent)
""")
_SERVING = text("""
SELECT worker_id, fingerprint, formats FROM agent_workers
WHERE agent = :agent AND seen_at > now() - make_interval(secs => :within) AND worker_id <> :exclude
""")


def register_names(conn: Connection, fingerprints: Mapping[str, dict[str, Any]]) -> None:
    """Record agent names (and their fingerprints) in ``agents``, in the caller's transaction."""
    # Sorted, so concurrent registrations lock the rows in one order.
    conn.execute(
        _NAMES,
        [
            {"agent": name, "fingerprint": payloads.dumps(fingerprint)}
            for name, fingerprint in sorted(fingerprints.items())
        ],
    )


def known_names(conn: Connection) -> builtins.list[str]:
    """Names of agents some worker registered, sorted."""
    return [row.name for row in conn.execute(_KNOWN_NAMES)]


class PostgresAgentRegistry:
    """Registrations of the agents each live worker serves."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def register(
        self,
        worker_id: str,
        fingerprints: Mapping[str, dict[str, Any]],
        formats: Iterable[int],
        limits: Mapping[str, ModelLimit] | None = None,
    ) -> None:
        """Record that ``worker_id`` serves these agents (and reads these checkpoint formats), now.

        ``limits``: the model limit the worker holds each agent's calls to (an agent left out has none). The agent
        names also go to ``agents``, the table producers check names against.
        """
        if not fingerprints:
            return
        readable = payloads.dumps(sorted(set(formats)))
        limits = limits or {}
        rows = [
            {
                "agent": name,
                "worker": worker_id,
                "fingerprint": payloads.dumps(fingerprint),
                "formats": readable,
                "limit": payloads.dumps(limits[name].model_dump()) if name in limits else None,
            }
            for name, fingerprint in sorted(fingerprints.items())
        ]
        with Transaction(self.engine) as conn:
            conn.execute(_EXPIRE)
            conn.execute(_REGISTER, rows)
            register_names(conn, fingerprints)

    def refresh(self, worker_id: str) -> None:
        """Say ``worker_id`` is still alive."""
        with Transaction(self.engine) as conn:
            conn.execute(_REFRESH, {"worker": worker_id})

    def forget(self, worker_id: str) -> None:
        """Drop a stopping worker's registrations."""
        with Transaction(self.engine) as conn:
            conn.execute(_FORGET, {"worker": worker_id})

    def live_agents(self, within_s: float) -> set[str]:
        """Agents at least one live worker (seen in the last ``within_s`` seconds) serves."""
        with Transaction(self.engine) as conn:
            return {row.agent for row in conn.execute(_LIVE_AGENTS, {"within": within_s})}

    def not_reading(self, checkpoint_format: int, within_s: float) -> builtins.list[str]:
        """Live workers (seen in the last ``within_s`` seconds) that do not read ``checkpoint_format``."""
        with Transaction(self.engine) as conn:
            rows = conn.execute(_BEHIND, {"format": payloads.dumps([checkpoint_format]), "within": within_s})
            return [row.worker_id for row in rows]

    def unregistered_for(self, agent: str, session_id: str) -> float | None:
        """Seconds since run ``session_id``'s first input, when no worker ever registered ``agent``; else None."""
        with Transaction(self.engine) as conn:
            waited = conn.execute(_UNREGISTERED_FOR, {"agent": agent, "sid": session_id}).scalar()
        return None if waited is None else float(waited)

    def limit_conflicts(self, within_s: float) -> builtins.list[LimitConflict]:
        """The model limit keys live workers (seen in the last ``within_s`` seconds) give different numbers.

        A registration whose limit no longer reads (written by another release) is left out.
        """
        with Transaction(self.engine) as conn:
            rows = conn.execute(_LIMITS, {"within": within_s}).all()
        registered = []
        for row in rows:
            try:
                registered.append((str(row.worker_id), ModelLimit.model_validate(row.model_limit)))
            except ValueError:
                continue
        return conflicts(registered)

    def serving(self, agent: str, within_s: float, exclude: str = "") -> builtins.list[Serving]:
        """Live registrations of ``agent`` (seen in the last ``within_s`` seconds), ``exclude`` left out."""
        with Transaction(self.engine) as conn:
            rows = conn.execute(_SERVING, {"agent": agent, "within": within_s, "exclude": exclude}).all()
        return [
            Serving(
                worker_id=row.worker_id,
                fingerprint=dict(row.fingerprint or {}),
                formats=[int(f) for f in row.formats or []],
            )
            for row in rows
        ]
