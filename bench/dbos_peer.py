"""The DBOS peer, bench side: its system database, its worker's command line, and one measured round of it.

It enqueues workflows with ``DBOSClient`` and reads the step records DBOS writes; the workflow itself is
``bench.dbos_app``, run in the worker subprocess. Needs the optional ``dbos`` package (``missing`` says so).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg

from bench.config import Config
from bench.dbos_app import APP_NAME, APP_VERSION, MODEL_STEP, QUEUE, STEP_TIMING, TOOL_STEP, WORKFLOW
from bench.results import RoundResult, read_lines, task_times
from bench.rounds import RoundSpec, wait_for
from bench.workers import BenchError

FAILED = ("ERROR", "CANCELLED", "MAX_RECOVERY_ATTEMPTS_EXCEEDED")


def missing() -> str | None:
    """Why the DBOS peer cannot run here (the ``dbos`` package is not importable), or None when it can."""
    try:
        import dbos  # noqa: F401  # only whether it imports
    except ImportError as exc:
        return (
            f"--peer dbos needs the optional dbos package, which is not importable here ({exc}); "
            "install it with `.venv/bin/pip install dbos`. Measuring the other systems without it."
        )
    return None


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


class DbosPeer:
    """The DBOS peer's system database, the command that serves it, and its rounds."""

    def __init__(self, config: Config, workdir: Path) -> None:
        self.config = config
        self.url = _plain(config.dbos_database_url)
        self.ready = workdir / "dbos-ready"
        self._db: psycopg.Connection[Any] | None = None
        self._client: Any = None

    def prepare(self) -> None:
        """Drop and recreate the peer's system database (its first serving process migrates it)."""
        admin = _plain(self.config.server_url)
        with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.config.dbos_database}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{self.config.dbos_database}"')

    def command(self) -> list[str]:
        """The worker's command line: ``--concurrency`` serving processes under one supervisor."""
        return [
            sys.executable,
            "-m",
            "bench.dbos_app",
            "--database-url",
            self.url,
            "--processes",
            str(self.config.concurrency),
            "--polling-s",
            str(self.config.dbos_polling_s),
            "--ready",
            str(self.ready),
            "--loglevel",
            self.config.loglevel,
        ]

    def connect(self, alive: Any, timeout_s: float = 90.0) -> None:
        """Wait until every serving process is ready (``alive()`` false means it died), then open the client."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.exists():
            if not alive():
                raise BenchError("the DBOS peer's worker exited before it was ready")
            if time.monotonic() > deadline:
                raise BenchError(f"the DBOS peer's worker was not ready in {timeout_s} s")
            time.sleep(0.1)
        from dbos import DBOSClient

        self._client = DBOSClient(system_database_url=self.url, application_name=APP_NAME)
        self._db = psycopg.connect(self.url, autocommit=True)

    @property
    def backend_pid(self) -> int:
        """The server process of the bench's own connection to the peer's database (0 before ``connect``)."""
        return self._db.info.backend_pid if self._db is not None else 0

    def close(self) -> None:
        """Close the client and the database connection (when they were opened)."""
        if self._client is not None:
            self._client.destroy()
        if self._db is not None:
            self._db.close()

    def round(self, spec: RoundSpec) -> RoundResult:
        """``runs`` concurrent workflows enqueued on the peer's queue; steps timed from ``operation_outputs``."""
        assert self._db is not None and self._client is not None
        db = self._db
        started = time.time()
        for i in range(spec.runs):
            options = {
                "workflow_name": WORKFLOW,
                "queue_name": QUEUE,
                "workflow_id": spec.run_id(i),
                "app_version": APP_VERSION,
            }
            self._client.enqueue(options, spec.length // 2, spec.result_bytes)

        def succeeded() -> int:
            row = db.execute(
                "SELECT count(*) FILTER (WHERE status = 'SUCCESS'),"
                " count(*) FILTER (WHERE status = ANY(%s))"
                " FROM dbos.workflow_status WHERE workflow_uuid LIKE %s",
                (list(FAILED), spec.prefix + "%"),
            ).fetchone()
            done, failed = (int(row[0]), int(row[1])) if row else (0, 0)
            if failed:
                raise BenchError(f"{failed} DBOS workflow(s) {spec.prefix}* failed")
            return done

        wait_for(spec, succeeded, spec.runs, "workflows succeeded")
        completed: dict[str, list[float]] = defaultdict(list)
        created: dict[str, float] = {}
        rows = db.execute(
            "SELECT o.workflow_uuid, s.created_at, o.completed_at_epoch_ms FROM dbos.operation_outputs o"
            " JOIN dbos.workflow_status s USING (workflow_uuid)"
            " WHERE o.workflow_uuid LIKE %s AND o.function_name = ANY(%s) ORDER BY o.workflow_uuid, o.function_id",
            (spec.prefix + "%", [MODEL_STEP, TOOL_STEP]),
        ).fetchall()
        for workflow_id, created_ms, completed_ms in rows:
            created[workflow_id] = int(created_ms) / 1000
            completed[workflow_id].append(int(completed_ms) / 1000)
        ended = max((times[-1] for times in completed.values()), default=started)
        tasks = task_times(read_lines(spec.timings), STEP_TIMING, spec.prefix)
        return spec.result(started, ended, completed, created, tasks)
