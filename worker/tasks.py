"""Celery tasks: ``lousho.advance`` (one step of one run), ``lousho.recover`` (the sweep), ``lousho.prune`` (retention).

Messages carry ids only (``session_id`` and ``seq``, as keyword arguments so Flower's search finds a run's
steps), under a name that says what the step is (``"support: tool batch"``, Celery's ``shadow`` name). A step
returns a short line with no content in it; one that parks its run fails, and one recorded for a retry
shows as retried, so Flower and the worker's log show each for what it is. Per-process state (engine, Redis client,
heartbeat, agents) is created lazily in the process that uses it, so prefork children never
share a connection inherited from the parent. The worker's parent registers the agents it loads
(and consumes their queues) before it reports ready, and keeps the registration fresh.

Stays whole: the Celery tasks and the process state they share (engine, clients, heartbeat); each task is a
thin wrapper over the step, the sweeps or retention.
"""

from __future__ import annotations

import contextvars
import logging
import os
import random
import socket
import threading
from pathlib import Path
from typing import Any, cast

from billiard.pool import EX_RECYCLE
from celery import shared_task, signals
from celery.exceptions import Retry
from celery.worker import state as worker_state
from kombu import Queue  # type: ignore[attr-defined]  # kombu does not list Queue in __all__
from sqlalchemy import Engine

from store import (
    broker,
    doctor,
    errors,
    interfaces,
    metrics,
    observed,
    records,
    redis_client,
    retention,
    step_message,
    telemetry,
)
from store.checkpoints import PostgresCheckpointStore
from store.database import make_engine
from store.inputs import normalize_input
from store.leases import Heartbeat, LeaseManager
from store.model_slots import RedisModelSlots
from store.registry import PostgresAgentRegistry
from store.schedules import PostgresScheduleStore
from store.signals import RedisSignals
from worker import agents as agent_registry
from worker import celery as lousho_celery
from worker import orphans, probes, recovery, slots, starts, tool_threads, tracing
from worker import schedules as schedule_sweep
from worker.celery import settings
from worker.retry import COUNTDOWN_MAX_S
from worker.steps import Outcome, StepDeps, run_step

log = logging.getLogger("lousho.tasks")

_state: dict[str, Any] = {"pid": None, "deps": None, "worker_id": ""}
_state_lock = threading.Lock()
#: Agents defined in code rather than in LOUSHO_AGENTS modules (tests, embedding apps).
extra_agents: dict[str, agent_registry.Agent] = {}
#: What each of Lousho's tasks carries itself, whatever the app's own defaults: JSON, late acks that requeue a
#: step whose process died (celery#1628; the attempts cap stops message loops), acks on failure and timeout
#: (failures are retried by our bounded logic, not by broker loops), and the step time limits.
TASK_OPTIONS: dict[str, Any] = {
    "serializer": "json",
    "acks_late": True,
    "reject_on_worker_lost": True,
    "acks_on_failure": True,
    "acks_on_timeout": True,
    "soft_time_limit": settings.step_soft_time_limit_s,
    "time_limit": settings.step_time_limit_s,
}


def deps() -> StepDeps:
    """This process's step dependencies, made on first use after a fork."""
    with _state_lock:
        if _state["pid"] != os.getpid():
            _state["deps"] = _build()
            _state["pid"] = os.getpid()
        built: StepDeps = _state["deps"]
        return built


def _engine() -> Engine:
    """This process's SQL engine, made with its step dependencies (the sweeps' stores use it too)."""
    deps()
    engine: Engine = _state["engine"]
    return engine


def _build() -> StepDeps:
    # Here, once per process after any fork (and in a solo or threads pool too): the span exporter's thread and
    # connections belong to the process that exports. Does nothing unless LOUSHO_TRACING is on.
    tracing.enable(settings)
    engine = _state["engine"] = make_engine(settings)
    # A pool process's steps keep their connection from one step to the next (the process's whole life).
    pool_process = _state.get("pool_process") == os.getpid()
    store = PostgresCheckpointStore(
        engine, settings.history_limit, events=settings.events, keep_connection=pool_process
    )
    client = _state["redis"] = redis_client.connect(
        settings, socket_timeout=5, socket_connect_timeout=5, health_check_interval=10
    )
    leases = LeaseManager(client, settings.lease_ttl_ms)
    agents = {**agent_registry.load_agents(settings.agent_modules), **extra_agents}
    model_slots = RedisModelSlots(client, settings.lease_ttl_ms)
    built = StepDeps(
        store=store,
        leases=leases,
        heartbeat=Heartbeat(leases, settings.lease_renew_ms),
        agents=agents,
        enqueue=enqueue,
        max_attempts=settings.max_attempts,
        retry_backoff_max_s=settings.retry_backoff_max_s,
        retry_for_s=settings.retry_for_s,
        registry=PostgresAgentRegistry(engine),
        worker_id=_state["worker_id"],
        signals=RedisSignals(client),
        registry_window_s=registration_window_s(),
        agent_grace_s=settings.agent_grace_s,
        slots=model_slots,
        slot_keeper=slots.SlotKeeper(model_slots),
        model_limits=settings.model_limit_table,
        fairness_weights=settings.fairness_weight_table,
        continue_steps=settings.continue_steps,
        continue_ms=float(settings.continue_ms),
        backlog=_backlog if settings.continue_steps > 1 else None,
    )
    try:
        store.register_agents({name: built.fingerprint(agent) for name, agent in agents.items()})
    except errors.StorageError:
        log.warning("could not register agents; producers will not check names until the next start")
    try:
        schedule_sweep.sync_declared(PostgresScheduleStore(engine), settings.agent_modules)
    except errors.StorageError:
        log.warning("could not sync the schedules declared in code; they sync at the next start")
    return built


#: The queue the step task running in this context came from (a chain shares its slice with what waits there).
_task_queue: contextvars.ContextVar[str | None] = contextvars.ContextVar("lousho_task_queue", default=None)


def _backlog() -> int:
    """Step messages waiting in the queue the running task came from (0 when unknown or unreadable).

    One LLEN of the transport's list for the queue (messages sent without a priority, as steps are).
    """
    queue = _task_queue.get()
    if not queue:
        return 0
    try:
        return broker.waiting(_redis_clients()[1], queue)
    except errors.StorageError:
        return 0


def enqueue(
    session_id: str, seq: int | None, countdown: float = 0.0, agent: str | None = None, /, *, name: str | None = None
) -> None:
    """Send ``advance`` for a run to its agent's queue (reuses the app's pooled producer connection).

    ``name`` is what Flower and the worker's log call the step (``telemetry.step_name``); ``agent``'s name
    with a plain ``step`` when not given.
    """
    advance.apply_async(
        kwargs=step_message.arguments(session_id, seq),
        countdown=countdown or None,
        **step_message.routing(settings, agent, name),
        **step_message.reprs(session_id, seq),
    )


def registration_refresh_s() -> float:
    """How often a worker says it is alive in the agent registry."""
    return max(0.5, min(15.0, settings.recover_interval_s))


def registration_window_s() -> float:
    """How recent a registration must be to count as a live worker (several missed refreshes)."""
    return observed.registration_window_s(settings)


@signals.worker_init.connect
def _start_metrics(sender: Any = None, **_: Any) -> None:
    """In the worker's parent, before the pool forks and before any agent module is imported: metrics on.

    Connected before ``_register_worker`` (which imports the agent modules): prometheus-client must be set
    to multiprocess mode before anything imports it. Off without ``LOUSHO_METRICS_PORT``, or in a worker that
    does not consume Lousho's queues; a problem is logged.
    """
    if sender is not None and lousho_celery.serves_lousho(sender):
        metrics.enable_worker(settings)


@signals.worker_process_shutdown.connect
def _forget_process_metrics(pid: int | None = None, **_: Any) -> None:
    """A pool process that exits keeps its counts in the metrics; its live-only values are dropped."""
    if pid is not None:
        metrics.mark_dead(pid)


@signals.worker_init.connect
def _register_worker(sender: Any = None, **_: Any) -> None:
    """In the worker's parent, before it reports ready: load the agents, consume their queues, register them.

    The agent modules are imported here so the children inherit them warm; the agents are registered
    with the checkpoint formats this release reads, so steps for them are routed here and handed-back
    steps know we exist. Only in a worker that consumes Lousho's queues (``worker.celery.serves_lousho``): a
    worker of a team's app started on the team's queues alone neither serves nor registers agents.
    """
    if sender is None or not lousho_celery.serves_lousho(sender):
        return
    _state["serving"] = True
    try:
        agents = {**agent_registry.load_agents(settings.agent_modules), **extra_agents}
    except errors.ConfigurationError as exc:
        log.error("agent modules could not be loaded: %s", exc)
        return
    try:
        settled = slots.settled_limits(agents.values(), settings.model_limit_table)
    except errors.ConfigurationError as exc:
        # One key with two sets of numbers in one worker: which would hold is a guess, so the worker does not start.
        log.critical("worker cannot start: %s", exc)
        raise SystemExit(1) from exc
    for name in sorted(agents):
        sender.app.amqp.queues.select_add(Queue(settings.agent_queue(name)))
    worker_id = _state["worker_id"] = f"{socket.gethostname()}:{os.getpid()}"
    # No pooled connection may outlive this call in a process that forks pool children (RELIABILITY P10).
    registry = PostgresAgentRegistry(make_engine(settings, pooled=False))
    fingerprints = {name: agent.fingerprint() for name, agent in agents.items()}
    held = {
        name: settled[limit.key]
        for name, agent in agents.items()
        if (limit := slots.limit_of(agent, settings.model_limit_table)) is not None and limit.key in settled
    }
    warned: set[str] = set()
    try:
        registry.register(worker_id, fingerprints, records.READ_FORMATS, held)
        _warn_conflicts(registry, {limit.key for limit in held.values()}, warned)
    except errors.StorageError as exc:
        log.warning("could not register agents (%s); retrying in the background", exc.code)
    stop = threading.Event()
    _state["registration_stop"] = stop

    def refresh() -> None:
        while not stop.wait(registration_refresh_s()):
            try:
                registry.register(worker_id, fingerprints, records.READ_FORMATS, held)
                _warn_conflicts(registry, {limit.key for limit in held.values()}, warned)
            except errors.StorageError:
                log.warning("could not refresh this worker's agent registration")

    threading.Thread(target=refresh, name="lousho-registry", daemon=True).start()
    _state["registry"] = registry
    _state["served"] = set(agents)


def _warn_conflicts(registry: PostgresAgentRegistry, keys: set[str], warned: set[str]) -> None:
    """Log, once per disagreement, each limit key of ``keys`` that live workers give different numbers.

    Workers of two releases during a deploy: the smallest number of each holds (``store.model_slots``) until they
    agree; ``lousho limits`` shows the same.
    """
    if not keys:
        return
    for conflict in registry.limit_conflicts(registration_window_s()):
        said = f"{conflict.key}: {sorted(conflict.given)}"
        if conflict.key in keys and said not in warned:
            warned.add(said)
            log.warning(
                "live workers give model limit %r different numbers (%s); the smallest holds: %s",
                conflict.key,
                "; ".join(f"{given} by {len(workers)} worker(s)" for given, workers in conflict.given.items()),
                conflict.holds.describe(),
            )


@signals.worker_shutdown.connect
def _forget_worker(**_: Any) -> None:
    """A stopping worker no longer counts as serving its agents."""
    watching = _state.get("dead_steps_stop")
    if watching is not None:
        watching.set()
    stop, registry = _state.get("registration_stop"), _state.get("registry")
    if stop is None or registry is None:
        return
    stop.set()
    try:
        registry.forget(_state["worker_id"])
    except errors.StorageError:
        log.warning("could not drop this worker's agent registration; it expires by itself")


#: How often the worker's main process looks for pool processes that died mid-step.
DEAD_STEP_CHECK_S = 0.2


@signals.worker_ready.connect
def _watch_dead_steps(**_: Any) -> None:
    """In the worker's main process, once it consumes: send at once the steps that died with a process of this host.

    First the runs whose leases dead processes of this host still hold (this worker restarted after it was killed
    whole), then, every ``DEAD_STEP_CHECK_S``, the step of any pool process that died mid-step (Celery itself
    requeues that message only when its pool notices, seconds later). Celery has no signal for a pool process's
    death in the main process: its accepted requests say which process runs which step (``worker.orphans``).
    """
    if _state.get("dead_steps_stop") is not None:
        return  # one watch per main process
    stop = threading.Event()
    _state["dead_steps_stop"] = stop
    threading.Thread(target=_dead_steps_loop, args=(stop,), name="lousho-dead-steps", daemon=True).start()


def _dead_steps_loop(stop: threading.Event) -> None:
    client = redis_client.connect(settings, socket_timeout=5, socket_connect_timeout=5, health_check_interval=10)
    leases = LeaseManager(client, settings.lease_ttl_ms)
    # No pooled connection in a process that forks pool children (RELIABILITY P10): each use connects anew.
    engine = make_engine(settings, pooled=False)
    store = PostgresCheckpointStore(engine, settings.history_limit)
    try:
        orphans.resend_at_start(store, leases, _resend_run, SWEEP_LIMIT)
    except Exception as exc:  # Postgres, Redis or the broker down at start: the sweep recovers those runs later
        log.warning(
            "could not look for runs left by dead processes at start (%s); the sweep recovers them", type(exc).__name__
        )
    watch = _state["dead_steps"] = orphans.DeadSteps(leases, _resend_step, store)
    try:
        while not stop.wait(DEAD_STEP_CHECK_S):
            try:
                watch.check(_pool_steps(), _pool_children())
            except Exception as exc:  # Redis or the broker down: the watch must outlive it; logged, tried again
                # Celery requeues the message itself once its pool notices; the step takes a dead holder's lease.
                log.warning("could not send on the step of a dead pool process: %s", type(exc).__name__)
    finally:
        engine.dispose()


@signals.task_received.connect
def _keep_received(request: Any = None, **_: Any) -> None:
    """Hand a step message this main process received to the dead-step watch (``DeadSteps.received``).

    A pool process can take a step and die between two checks, and Celery can drop that request (requeueing a copy
    whose seq is stale) before the next check lists it.
    """
    watch: orphans.DeadSteps | None = _state.get("dead_steps")
    step = _as_step(request) if watch is not None and request is not None else None
    if watch is not None and step is not None:
        watch.received(step)


def _pool_steps() -> list[orphans.PoolStep]:
    """The step messages this worker holds, from Celery's requests (read in the main process).

    Reserved requests, not only the active ones: a pool process can die after it took a step's lease and before the
    main process learnt that it accepted the step.
    """
    for _ in range(5):
        try:
            requests = list(worker_state.reserved_requests)
            break
        except RuntimeError:  # the event loop changed the set while it was being copied: read again
            continue
    else:
        return []
    return [step for step in map(_as_step, requests) if step is not None]


def _as_step(request: Any) -> orphans.PoolStep | None:
    """The step a Celery request carries (None for another task's)."""
    pid, kwargs = request.worker_pid, request.kwargs
    if request.type != advance.name or not isinstance(kwargs, dict) or not isinstance(kwargs.get("session_id"), str):
        return None
    if not isinstance(pid, int) or pid == os.getpid():
        pid = None
    info = request.delivery_info or {}
    return orphans.PoolStep(str(request.id), pid, kwargs["session_id"], info.get("routing_key") or None, request.name)


def _pool_children() -> list[int] | None:
    """This main process's child processes (the pool's, an exited one not yet reaped included); None if unknown."""
    pid = os.getpid()
    try:
        listed = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return None
    return [int(child) for child in listed.split()]


def _resend_step(step: orphans.PoolStep) -> None:
    """Send a dead pool process's step again, to the queue it came from under the name it had."""
    route = step_message.routing(settings, None, step.name, kind=telemetry.RECOVERY)
    route["queue"] = step.queue or route["queue"]
    advance.apply_async(kwargs=step_message.arguments(step.session_id, None), **route)


def _resend_run(run: records.DueRun) -> None:
    """Send a step for a run a dead process of this host held (to its agent's queue when this worker serves it)."""
    served = _state.get("served") or set()
    enqueue(
        run.session_id,
        run.seq,
        0.0,
        run.agent if run.agent in served else None,
        name=telemetry.step_name(run.agent, telemetry.RECOVERY),
    )


@signals.worker_ready.connect
def _start_heartbeat(sender: Any = None, **_: Any) -> None:
    """In the worker's parent, once it consumes: touch ``LOUSHO_HEARTBEAT_FILE`` while it keeps consuming.

    The ticks run on the consumer's event loop (``worker.probes.watch``); a received task message counts as
    consuming. Off without the setting.
    """
    if not settings.heartbeat_file or sender is None or not _state.get("serving"):
        return
    heartbeat = probes.Heartbeat(Path(settings.heartbeat_file))
    signals.task_received.connect(lambda **_: heartbeat.received(), weak=False)
    probes.watch(sender, heartbeat, lambda: len(worker_state.reserved_requests))


@signals.worker_process_init.connect
def _warm_process(**_: Any) -> None:
    """Build this pool process's connections before its first task, and note that it is a pool process.

    A replacement for a killed process then recovers runs without first paying for its setup. In a
    thread: process start must stay fast (Celery gives it a few seconds) even when a service answers slowly.
    Only in a worker that runs Lousho's steps.
    """
    if not _state.get("serving"):
        return
    _state["pool_process"] = os.getpid()  # it may end itself to shed hung tool calls (``_recycle_if_hung``)

    def warm() -> None:
        try:
            deps()
        except errors.LoushoError as exc:
            log.warning("pool process starts cold (%s); its first task builds what it needs", type(exc).__name__)

    threading.Thread(target=warm, name="lousho-warm", daemon=True).start()


@signals.worker_process_shutdown.connect
def _flush_spans(**_: Any) -> None:
    """At a pool process's end: its last spans exported, the connection its steps kept given back.

    The process exits without running ``atexit`` handlers.
    """
    tracing.flush()
    built = _state.get("deps") if _state.get("pid") == os.getpid() else None
    if built is not None and isinstance(built.store, PostgresCheckpointStore):
        built.store.close()


class StepFailed(Exception):
    """A step that parked its run (the run waits for ``resume()``): the task fails with the step's summary."""


@shared_task(
    name=step_message.ADVANCE, bind=True, ignore_result=True, throws=(StepFailed,), queue=settings.queue, **TASK_OPTIONS
)
def advance(self: Any, session_id: str, seq: int | None = None) -> str:
    """Do one step of the run ``session_id``; ``seq`` (when given) drops stale duplicates.

    Returns:
        What the step did, in a few words with no content (``"model turn: 2 tool calls"``).

    Raises:
        StepFailed: the step parked the run.
        Retry: the step failed and the run's retry is recorded (the retry message is already sent, or the
            sweep sends it); Celery shows the task as retried and acks the message.
    """
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool)):
        log.warning("advance with a malformed seq dropped")
        return "malformed message; dropped"
    queued = _task_queue.set((self.request.delivery_info or {}).get("routing_key") or None)
    with telemetry.step(session_id, seq, task_id=self.request.id) as report:
        try:
            try:
                outcome = run_step(deps(), session_id, seq)
            finally:
                _task_queue.reset(queued)
        except errors.SessionIdInvalidError:
            log.warning("advance for an invalid session id dropped")
            return "invalid run id; dropped"
        except errors.ConfigurationError as exc:
            log.error("worker misconfigured, step of %s not run: %s", session_id, exc)
            report.outcome, report.error_code = "misconfigured", exc.code
            raise StepFailed(f"worker misconfigured: {exc.code}") from None
        except errors.StorageError as exc:
            # The sweep re-enqueues the run once the services are back; no broker loop here.
            log.warning("step of %s could not reach a service: %s", session_id, type(exc).__name__)
            return f"services unreachable ({type(exc).__name__}); the sweep sends the step again"
        if not report.chained:  # a chained task's steps noted their own outcomes
            report.outcome = outcome.value
        log.info("advance %s seq=%s -> %s", session_id, seq, outcome.value)
    summary = report.summary()
    _recycle_if_hung()
    if outcome is Outcome.PARKED:
        raise StepFailed(summary)
    if outcome in (Outcome.FAILED, Outcome.HANDED_BACK):
        raise Retry(summary, StepFailed(summary), report.last.retry_in)
    return summary


def _recycle_if_hung() -> None:
    """End this pool process once its step is done when more than ``LOUSHO_HUNG_TOOL_CALLS_MAX`` calls hung in it.

    Python cannot stop a thread: calls given up on past their timeout keep their threads (and whatever they hold)
    until the process ends. Only a prefork pool process ends itself, after its step saved, sent its next message
    and released its lease; Celery starts a fresh one, and the message of the step, taken for lost, comes back
    once and is dropped as stale (harmless, as any duplicate). A solo or threads pool is the worker itself: there
    the count is only logged.
    """
    hung = tool_threads.process_threads().hung
    if hung <= settings.hung_tool_calls_max:
        return
    if _state.get("pool_process") != os.getpid():
        log.warning(
            "%d tool calls hung in this worker (LOUSHO_HUNG_TOOL_CALLS_MAX is %d); only a prefork pool"
            " process is recycled",
            hung,
            settings.hung_tool_calls_max,
        )
        return
    log.warning(
        "%d tool calls hung in this pool process (LOUSHO_HUNG_TOOL_CALLS_MAX is %d); it exits after this"
        " step and Celery starts a fresh one",
        hung,
        settings.hung_tool_calls_max,
    )
    signals.worker_process_shutdown.send(sender=None, pid=os.getpid(), exitcode=EX_RECYCLE)
    os._exit(EX_RECYCLE)


#: Runs the sweep sends at most per pass; the rest wait for the next pass, most overdue first.
SWEEP_LIMIT = 500


# The one task whose result is stored (where the app has a result backend): its caller learns the run id.
@shared_task(
    name=starts.START_TASK, bind=True, ignore_result=False, queue=starts.start_queue(settings.queue), **TASK_OPTIONS
)
def start(
    self: Any,
    agent: str,
    input: Any,
    session_id: str | None = None,
    metadata: dict[str, Any] | None = None,
    beat_entry: str | None = None,
    every_s: float | None = None,
    fairness_key: str | None = None,
) -> str:
    """Start or continue a run of ``agent`` with ``input``, at most once per message (``worker.starts``).

    For any Celery app, by name: ``send_task("lousho.start", kwargs={"agent": ..., "input": ...,
    "session_id": ..., "metadata": ..., "fairness_key": ...}, queue="<LOUSHO_QUEUE>-start")``. ``beat_entry`` and
    ``every_s`` come from entries made by ``worker.starts.beat_entry``; ``fairness_key`` as ``send``'s.

    Returns:
        The run's id (``session_id``, or the one made from the task id or the beat entry's tick): the task's
        result, for a caller whose app shares the worker's result backend.

    Raises:
        SessionIdInvalidError, InputTooLargeError, AgentNotFoundError, SessionAwaitingApprovalError,
            ConfigurationError: the message cannot start anything (a bad fairness key, say); the task fails (Flower
            shows it) and is not retried.
    """
    sent_at = self.request.get(starts.SENT_AT_HEADER)
    run_id, key = starts.run_id_for(
        str(self.request.id or ""),
        session_id,
        beat_entry,
        every_s,
        float(sent_at) if isinstance(sent_at, int | float) else None,
    )
    records.validate_agent_name(agent)
    messages = normalize_input(input)
    built = deps()
    served = _served()
    if agent not in built.agents and agent not in served:
        raise errors.AgentNotFoundError(agent, sorted(set(built.agents) | served))
    store = cast(interfaces.CheckpointStore, built.store)
    number = store.append_input(run_id, agent, messages, key, metadata, fairness_key=fairness_key)
    enqueue(run_id, None, 0.0, agent if agent in served else None, name=telemetry.step_name(agent, telemetry.NEW_INPUT))
    log.info("start: input %d of run %s queued", number, run_id)
    return run_id


def _served() -> set[str]:
    """The agents live workers serve (empty when the registry cannot be read)."""
    built = deps()
    try:
        return built.registry.live_agents(registration_window_s()) if built.registry is not None else set()
    except errors.StorageError:
        return set()


# The sweeps send no task events (nor does beat a task-sent event for them, ``worker.celery``): run every few
# seconds, they would bury the steps in Flower's task list. Their work shows in the metrics and the log.
@shared_task(
    name="lousho.recover",
    ignore_result=True,
    send_events=False,
    queue=lousho_celery.control_queue(settings),
    **TASK_OPTIONS,
)
def recover() -> int:
    """Send a step for each run that can move and is not moving.

    Such a run was silent for a lease TTL with no live lease, or is due for a retry. Parked, paused
    and waiting runs are never sent. Approvals past their expiry are rejected first, so a run that
    expiry lets continue is sent in the same pass (once its pause is a lease TTL old). Each run sent is marked
    recovering: a later pass tells its agent how it came out (``on_recovered``/``on_error``, ``worker.recovery``).

    Returns:
        How many runs were sent.
    """
    built = deps()
    try:
        # First the report on the runs earlier passes sent on (each once), then this pass's sends.
        recovery.report(built.store, built.agents, SWEEP_LIMIT)
    except errors.StorageError as exc:
        log.warning("recover: could not read which recovered runs to report (%s); the next pass does", exc.code)
    # Bounded per pass like the sends; the rest expire at the next pass.
    expired = built.store.expire_approvals(SWEEP_LIMIT)
    if expired:
        log.info("recover: %d approval(s) expired undecided", expired)
    stale_after = max(settings.lease_ttl_ms / 1000, 0.5)
    # Retries that come due together (an outage ended) are spread over a few seconds.
    spread = min(COUNTDOWN_MAX_S, settings.recover_interval_s)
    # A run whose agent no live worker serves goes to the shared queue, which every worker consumes: the
    # worker that takes it hands it back, or parks it once LOUSHO_RETRY_FOR_S is spent. Its own queue
    # would hold it unread.
    served = _served()
    sent, after = 0, None
    while sent < SWEEP_LIMIT:
        page = built.store.due_runs(stale_after, SWEEP_LIMIT, after)
        if not page:
            break
        after = page[-1]
        live = built.leases.held([run.session_id for run in page])
        # A run waiting on a model limit has a waiter (I19): its wake-up or countdown brings it back.
        live |= set(_waiting_on_limits(built, [run.session_id for run in page]))
        swept = []
        for run in page:
            if run.session_id in live or sent >= SWEEP_LIMIT:
                continue
            try:
                records.validate_session_id(run.session_id)
            except errors.SessionIdInvalidError:
                continue
            enqueue(
                run.session_id,
                run.seq,
                random.uniform(0, spread) if run.retrying else 0.0,
                run.agent if run.agent in served else None,
                name=telemetry.step_name(run.agent, telemetry.RETRY if run.retrying else telemetry.RECOVERY),
            )
            swept.append(run.session_id)
            sent += 1
        # Sent once per lease TTL at most: a run still queued behind a backlog is not sent again each pass.
        built.store.mark_swept(swept)
        if len(page) < SWEEP_LIMIT:
            break
    sent += _wake_leads(built, stale_after)
    sent += _wake_slot_waiters(built)
    telemetry.count("sweep.resent", sent)
    if sent:
        log.info("recover: re-enqueued %d run(s)", sent)
    return sent


def _waiting_on_limits(built: StepDeps, session_ids: list[str]) -> dict[str, tuple[str, str]]:
    """Which of these runs wait on a model limit (Redis down: none, and the sweep sends them like the others)."""
    if built.slots is None:
        return {}
    try:
        return built.slots.waiting(session_ids)
    except errors.StorageError:
        return {}


def _wake_slot_waiters(built: StepDeps) -> int:
    """Give the model slots of dead holders (expired, never released) to the runs waiting for one."""
    if built.slots is None:
        return 0
    try:
        woken = built.slots.wake()
    except errors.StorageError as exc:
        log.warning("recover: could not look at the model limits (%s)", exc.code)
        return 0
    served = _served()
    for session_id, agent in woken:
        enqueue(
            session_id,
            None,
            0.0,
            agent if agent in served else None,
            name=telemetry.step_name(agent or None, telemetry.SLOT_FREED),
        )
    return len(woken)


def _wake_leads(built: StepDeps, stale_after: float) -> int:
    """Send a step to each lead whose children have all settled but whose wake-up was lost."""
    leads = built.store.waiting_leads(stale_after, SWEEP_LIMIT)
    live = built.leases.held([lead.session_id for lead in leads])
    woken = [lead for lead in leads if lead.session_id not in live]
    for lead in woken:
        enqueue(lead.session_id, None, 0.0, None, name=telemetry.step_name(lead.agent, telemetry.CHILDREN_SETTLED))
    built.store.mark_swept([lead.session_id for lead in woken])
    return len(woken)


@shared_task(
    name="lousho.schedules",
    ignore_result=True,
    send_events=False,
    queue=lousho_celery.control_queue(settings),
    **TASK_OPTIONS,
)
def fire_schedules() -> None:
    """Claim every due schedule tick in Postgres with its run, then enqueue the runs (safe from any number of beats)."""
    result = schedule_sweep.sweep(PostgresScheduleStore(_engine()), grace=settings.schedule_grace)
    sent = schedule_sweep.publish(
        result,
        lambda session_id: enqueue(
            session_id,
            None,
            0.0,
            result.agents.get(session_id),
            name=telemetry.step_name(result.agents.get(session_id), telemetry.NEW_INPUT),
        ),
    )
    telemetry.count("schedule.fired", sent)
    telemetry.count("schedule.skipped", result.skipped)
    telemetry.count("schedule.missed", result.missed)
    if sent or result.skipped or result.missed or result.broken:
        log.info(
            "schedules: %d run(s) started, %d tick(s) skipped for overlap, %d overdue tick(s) dropped,"
            " %d schedule(s) found broken",
            sent,
            result.skipped,
            result.missed,
            len(result.broken),
        )


def _redis_clients() -> tuple[redis_client.Client, redis_client.Client]:
    """This process's Redis connections: the leases', and the broker's for reading step messages.

    One connection when the broker is the same URL.
    """
    deps()  # the leases' connection is made with the process's step dependencies
    leases: redis_client.Client = _state["redis"]
    if settings.broker == settings.redis_url:
        return leases, leases
    if "broker" not in _state:
        _state["broker"] = redis_client.connect(
            settings, url=settings.broker, socket_timeout=5, socket_connect_timeout=5
        )
    return leases, _state["broker"]


@shared_task(
    name="lousho.doctor",
    ignore_result=True,
    send_events=False,
    queue=lousho_celery.control_queue(settings),
    **TASK_OPTIONS,
)
def doctor_look() -> int:
    """One look of the I19 checker: every unfinished run has an owner, a timer or a waiter (``store.doctor``).

    Keeps its verdict in Postgres, where ``/metrics`` reads ``lousho_runs_unexplained``; logs each run it finds
    unexplained (ids and states only). It moves no run.

    Returns:
        How many runs it found unexplained.
    """
    leases, broker_client = _redis_clients()
    found = doctor.look(_engine(), leases, broker_client, settings)
    for finding in found.unexplained:
        log.warning(
            "doctor: run %s (%s, agent %s) has no owner, timer or waiter since %s",
            finding.summary.session_id,
            finding.summary.state,
            finding.summary.agent,
            finding.first_seen.isoformat(),
        )
    if not found.complete:
        log.warning("doctor: the look stopped at %d runs or at the broker's message limit", found.checked)
    return len(found.unexplained)


@shared_task(
    name="lousho.prune",
    ignore_result=True,
    send_events=False,
    queue=lousho_celery.control_queue(settings),
    **TASK_OPTIONS,
)
def prune() -> int:
    """One pass of the retention sweep: finished runs past ``LOUSHO_RETENTION_DAYS``, then keys past their age.

    Bounded (``store.retention.sweep``): a backlog of millions is worked off over many passes, so beat never
    waits on one. Does nothing while ``LOUSHO_RETENTION_DAYS`` is unset.

    Returns:
        How many runs were pruned (sub-agent runs included).
    """
    policy = retention.Retention.from_days(settings.retention_days, settings.retention_keys_days)
    if policy.runs is None:
        return 0
    done = retention.sweep(_engine(), policy)
    if done.runs or done.deliveries or done.bodies or done.ticks:
        log.info(
            "prune: %d run(s) with %d history entries, %d events and %d approvals; %d delivery id(s),"
            " %d body hash(es), %d tick(s)%s",
            done.runs,
            done.history,
            done.events,
            done.approvals,
            done.deliveries,
            done.bodies,
            done.ticks,
            "; more are due" if done.more else "",
        )
    return done.runs


__all__ = [
    "Outcome",
    "StepFailed",
    "advance",
    "deps",
    "doctor_look",
    "enqueue",
    "extra_agents",
    "fire_schedules",
    "prune",
    "recover",
]
