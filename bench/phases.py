"""The phases of a step: timers wrapped around every dependency ``run_step`` calls, per variant and phase.

Used by ``bench.profile_step`` in its own process only; it changes nothing in the project's files.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from store.checkpoints import PostgresCheckpointStore
    from store.settings import Settings
    from worker.context import StepDeps

#: variant -> phase -> durations (s), wall clock and this thread's CPU; ``current`` names the variant.
spent: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
cpu: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
current = ["warm-up"]


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` recording its wall and CPU duration under ``name`` for the variant being measured."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started, thread_cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[current[0]][name].append(time.perf_counter() - started)
            cpu[current[0]][name].append(time.thread_time() - thread_cpu)

    return wrapper


def engine_for(deps: StepDeps, settings: Settings, variant: str) -> Engine:
    """The checkpoint store's engine for ``variant``: the worker's own for ``default``.

    ``pre-ping`` is the same engine with SQLAlchemy's ``pool_pre_ping``: a ``SELECT 1`` before each
    checkout, which the project replaced by a check of the idle socket (``store.database``).
    """
    from sqlalchemy import create_engine

    from store.checkpoints import PostgresCheckpointStore

    if variant == "default":
        # The worker's stores are typed by their ports; the profile measures the Postgres one.
        if not isinstance(deps.store, PostgresCheckpointStore):
            raise TypeError("profile_step measures the Postgres checkpoint store")
        return deps.store.engine
    options: dict[str, Any] = {
        "pool_size": 2,
        "max_overflow": 4,
        "pool_pre_ping": True,
        "hide_parameters": True,
        "connect_args": {"connect_timeout": 5, "application_name": "lousho"},
    }
    return create_engine(settings.sqlalchemy_url, **options)


def instrument_stores(deps: StepDeps, settings: Settings, engines: list[str]) -> dict[str, PostgresCheckpointStore]:
    """One checkpoint store per engine variant, its calls wrapped with timers.

    Instance attributes shadow the methods; sub-phases (indented names) are also counted inside their phase.
    """
    from store.checkpoints import PostgresCheckpointStore

    stores = {}
    for variant in engines:
        variant_store = PostgresCheckpointStore(engine_for(deps, settings, variant), settings.history_limit)
        variant_store.claim = timed("claim-and-load", variant_store.claim)  # type: ignore[method-assign]
        variant_store.inbox = timed("inbox read (first step only)", variant_store.inbox)  # type: ignore[method-assign]
        variant_store.record_step = timed(  # type: ignore[method-assign]
            "fenced save + history", variant_store.record_step
        )
        variant_store.note_usage = timed(  # type: ignore[method-assign]
            "usage note (model turns, --usage)", variant_store.note_usage
        )
        dialect = variant_store.engine.dialect
        if variant == "pre-ping":
            dialect.do_ping = timed("  pool pre-ping", dialect.do_ping)  # type: ignore[method-assign]
        stores[variant] = variant_store
    return stores


def instrument_step_calls(deps: StepDeps) -> dict[str, int | None]:
    """Wrap the lease, heartbeat, enqueue and module functions the step calls; return the enqueued seqs.

    Module functions are looked up at call time, so replacing them is seen by the step. The returned dict
    maps a run to the seq of its next step, filled as the step enqueues it.
    """
    import store.payloads
    import store.runs
    import worker.machine
    from store.records import Checkpoint

    next_seq: dict[str, int | None] = {}
    enqueue = timed("enqueue (Celery publish)", deps.enqueue)

    def capture(
        session_id: str, seq: int | None, countdown: float = 0.0, agent: str | None = None, /, **options: Any
    ) -> None:
        next_seq[session_id] = seq
        enqueue(session_id, seq, countdown, agent, **options)

    deps.enqueue = capture
    deps.leases.acquire = timed("lease acquire (Lua SET NX + INCR)", deps.leases.acquire)  # type: ignore[method-assign]
    deps.leases.release = timed("lease release (Lua compare-and-delete)", deps.leases.release)  # type: ignore[method-assign]
    deps.heartbeat.hold = timed("heartbeat hold+drop", deps.heartbeat.hold)  # type: ignore[method-assign]
    deps.heartbeat.drop = timed("heartbeat hold+drop", deps.heartbeat.drop)  # type: ignore[method-assign]
    store.runs.row_checkpoint = timed("  row -> Checkpoint (pydantic)", store.runs.row_checkpoint)
    Checkpoint.document = timed("  Checkpoint.document (model_dump)", Checkpoint.document)  # type: ignore[method-assign]
    store.payloads.dumps = timed("  json dumps", store.payloads.dumps)
    worker.machine.plan = timed("plan (pure step machine)", worker.machine.plan)
    return next_seq


def instrument_agent(deps: StepDeps, agent_name: str) -> None:
    """Wrap the bench agent's model turn and its no-op tool."""
    agent = deps.agents[agent_name]
    agent.model.generate = timed("model turn (MockModel)", agent.model.generate)  # type: ignore[method-assign,union-attr]
    noop = agent.tools["noop"]
    noop.invoke = timed("tool call (no-op, validated)", noop.invoke)  # type: ignore[method-assign]
