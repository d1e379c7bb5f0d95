"""Celery tasks: ``lousho.advance`` (one step of one run) and ``lousho.recover`` (the sweep).

Messages carry ids only (session id and seq). Per-process state (engine, Redis client,
heartbeat, agents) is created lazily in the process that uses it, so prefork children never
share a connection inherited from the parent.
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from typing import Any

import redis
from celery import signals

from store import errors, records
from store.checkpoints import PostgresCheckpointStore
from store.database import make_engine
from store.leases import Heartbeat, LeaseManager
from store.schedules import PostgresScheduleStore
from worker import agents as agent_registry
from worker import schedules as schedule_sweep
from worker.celery import app, settings
from worker.steps import Outcome, StepDeps, run_step

log = logging.getLogger("lousho.tasks")

_state: dict[str, Any] = {"pid": None, "deps": None}
_state_lock = threading.Lock()
#: Agents defined in code rather than in LOUSHO_AGENTS modules (tests, embedding apps).
extra_agents: dict[str, agent_registry.Agent] = {}


def deps() -> StepDeps:
    """This process's step dependencies, made on first use after a fork."""
    with _state_lock:
        if _state["pid"] != os.getpid():
            _state["deps"] = _build()
            _state["pid"] = os.getpid()
        built: StepDeps = _state["deps"]
        return built


def _build() -> StepDeps:
    store = PostgresCheckpointStore(make_engine(settings), settings.history_limit)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5,
                                  health_check_interval=10)
    leases = LeaseManager(client, settings.lease_ttl_ms)
    agents = {**agent_registry.load_agents(settings.agent_modules), **extra_agents}
    built = StepDeps(store=store, leases=leases, heartbeat=Heartbeat(leases, settings.lease_renew_ms),
                     agents=agents, enqueue=enqueue, max_attempts=settings.max_attempts,
                     retry_backoff_max_s=min(settings.retry_backoff_max_s, settings.visibility_timeout_s / 4))
    try:
        store.register_agents({name: built.fingerprint(agent) for name, agent in agents.items()})
    except errors.StorageError:
        log.warning("could not register agents; producers will not check names until the next start")
    try:
        schedule_sweep.sync_declared(PostgresScheduleStore(store.engine), settings.agent_modules)
    except errors.StorageError:
        log.warning("could not sync the schedules declared in code; they sync at the next start")
    return built


def enqueue(session_id: str, seq: int | None, countdown: float = 0.0) -> None:
    """Send ``advance`` for a run (reuses the app's pooled producer connection)."""
    advance.apply_async((session_id, seq), countdown=countdown or None)


@signals.worker_init.connect
def _preload_agents(**_: Any) -> None:
    """Import the agent modules once in the parent so prefork children inherit them warm."""
    try:
        agent_registry.load_agents(settings.agent_modules)
    except errors.ConfigurationError as exc:
        log.error("agent modules could not be loaded: %s", exc)


@signals.worker_process_init.connect
def _warm_process(**_: Any) -> None:
    """Build this pool process's connections before its first task, so a replacement for a killed
    process recovers runs without first paying for its setup. In a thread: process start must stay
    fast (Celery gives it a few seconds) even when a service answers slowly."""

    def warm() -> None:
        try:
            deps()
        except (errors.LoushoError, redis.RedisError) as exc:
            log.warning("pool process starts cold (%s); its first task builds what it needs", type(exc).__name__)

    threading.Thread(target=warm, name="lousho-warm", daemon=True).start()


@app.task(name="lousho.advance", ignore_result=True)
def advance(session_id: str, seq: int | None = None) -> None:
    """Do one step of the run ``session_id``; ``seq`` (when given) drops stale duplicates."""
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool)):
        log.warning("advance with a malformed seq dropped")
        return
    try:
        outcome = run_step(deps(), session_id, seq)
    except errors.SessionIdInvalidError:
        log.warning("advance for an invalid session id dropped")
        return
    except errors.ConfigurationError as exc:
        log.error("worker misconfigured, step of %s not run: %s", session_id, exc)
        return
    except (errors.StorageError, redis.RedisError) as exc:
        # The sweep re-enqueues the run once the services are back; no broker loop here.
        log.warning("step of %s could not reach a service: %s", session_id, type(exc).__name__)
        return
    log.info("advance %s seq=%s -> %s", session_id, seq, outcome.value)


@app.task(name="lousho.recover", ignore_result=True)
def recover() -> int:
    """Re-enqueue in-progress runs that stopped moving and hold no live lease; returns how many."""
    built = deps()
    stale_after = max(settings.lease_ttl_ms / 1000, 0.5)
    candidates = built.store.stale_runs(stale_after)
    live = built.leases.held([sid for sid, _ in candidates])
    sent = 0
    for session_id, seq in candidates:
        if session_id in live:
            continue
        try:
            records.validate_session_id(session_id)
        except errors.SessionIdInvalidError:
            continue
        enqueue(session_id, seq)
        sent += 1
    if sent:
        log.info("recover: re-enqueued %d run(s)", sent)
    return sent


@app.task(name="lousho.schedules", ignore_result=True)
def fire_schedules() -> None:
    """Claim every due schedule tick in Postgres with its run, then enqueue the runs (safe from any number of beats)."""
    result = schedule_sweep.sweep(PostgresScheduleStore(deps().store.engine),
                                  grace=timedelta(seconds=max(settings.schedule_grace_s,
                                                              3 * settings.schedule_interval_s)))
    sent = schedule_sweep.publish(result, lambda session_id: enqueue(session_id, None))
    if sent or result.skipped or result.missed:
        log.info("schedules: %d run(s) started, %d tick(s) skipped for overlap, %d overdue tick(s) dropped",
                 sent, result.skipped, result.missed)


__all__ = ["Outcome", "advance", "deps", "enqueue", "extra_agents", "fire_schedules", "recover"]
