"""Soak (issue 18): many runs through real workers while workers, Redis and Postgres are killed, on private servers.

Two workers (``-c 2``) and a beat run on a private Postgres and a private Redis (broker and leases) that
the test starts (``tests/soak/conftest.py``); the machine's servers are never touched. ``in_flight``
runs of the ``chaos`` agent are under way at any time, each of ``turns`` model turns with tool batches of
3 and 2 calls in turn; some have an approval-gated call, approved as soon as it is asked for, and some get
a follow-up (a second send) once finished. Meanwhile the faults of a plan fire as the runs go out, each
once the cluster is whole again (arrivals wait for a fault that waits for the cluster to heal):

- worker kills (RELIABILITY C5): one pool child (50%), the whole process group (40%) or the main process
  only (10%) of a random worker; a killed worker comes back after 0.5-2 s;
- Redis SIGKILLed and restarted, alternating: without persistence (every key lost, C6), then with the
  append-only file on (``appendfsync everysec``) from that restart on, so the next kill replays it (C7);
- Postgres stopped with ``pg_ctl stop -m immediate``, down 3 s, started (C8).

A worker or beat that exits by itself is restarted after a second, as its deployment would do, and
listed: only the known exit is allowed (the broker lost mid-ack when Redis dies, within 10 s of a Redis
restart, ``tests.support.soak.worker_exit``); any other fails the soak.

Then the runs drain and the checker of RELIABILITY section 4 runs over every run: no violation of the
invariants it checks, every run finished with its follow-up applied exactly once,
every recovery p99 within I11's budget plus the queue and a loaded machine's noise, and every worker
consuming again within 30 s of a restart (P6).

Figures printed (and written to ``soak-figures.json`` in the work folder): runs, follow-ups and approvals,
faults by kind, recovery p50/p99/max per fault kind (worker kills from the checker's recovery episodes;
Redis and Postgres restarts from the server answering again to each affected run's next save), each
worker's time to its first task after a restart, worker memory (``VmRSS`` of the main and pool
processes, first and last reading), and the recovery sweep's time per pass as the finished runs grow.

The same test is the long soak: ``LOUSHO_SOAK_RUNS=2000`` (see the conftest for the other knobs).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import kombu.exceptions
import psycopg
import pytest
import redis

from store import errors
from tests.support import checker
from tests.support.agents import run_input
from tests.support.cluster import RecoveryBudget, Worker
from tests.support.private_postgres import PrivatePostgres
from tests.support.soak import (
    CONFIG,
    MemoryReading,
    PrivateRedis,
    SoakCluster,
    SoakConfig,
    SweepPass,
    WorkerExit,
    first_after,
    memory_summary,
    read_memory,
    recovery_by_action,
    sweep_cost,
    sweep_passes,
    worker_exit,
)

pytestmark = [pytest.mark.soak, pytest.mark.timeout(CONFIG.timeout_s)]

AGENT = "chaos"
WORKERS = ("w1", "w2")
CONCURRENCY = 2
#: Tool batches of 3 and 2 calls sleeping 100-400 ms, model turns of 150 ms (``SoakConfig.turns`` of them).
RUN_SHAPE = {"calls": "3,2", "sleep": "100-400", "model": 150}
#: Call 1 of turn 1 needs a human's approval.
GATE = {"gate": "1.1"}
KILL_ACTIONS = ("kill-child", "kill-group", "kill-main")
REDIS_LOST, REDIS_AOF, POSTGRES = "redis-restart-lost", "redis-restart-aof", "postgres-restart"
REDIS_DOWN_S = 1.0
POSTGRES_DOWN_S = 3.0
#: At least this long between the end of a fault and the next one.
GAP_S = 1.5
#: After a Redis or Postgres restart the next fault waits until every run it hit saved again, at most this long.
SETTLE_MAX_S = 20.0
#: RELIABILITY P6: a worker consumes again at most this long after a Redis restart.
CONSUME_WITHIN_S = 30.0
POLL_S = 0.2
#: Scheduling noise on a loaded 2-core machine (16 processes of ours next to other people's tests): processes
#: woken late, the beat's tick and the sweep's commits delayed; twice the chaos test's second.
LOADED_MACHINE_S = 2.0
#: A worker that exited by itself comes back this long after (a deployment's restart policy).
SUPERVISOR_DELAY_S = 1.0
#: A worker may exit by itself only this soon after a Redis restart (kombu losing its connection mid-ack,
#: see ``tests.support.soak.worker_exit``); any other exit fails the soak.
EXIT_AFTER_REDIS_S = 10.0
#: A worker nobody killed must be ready (alive, its pool complete) again within this long.
UNREADY_MAX_S = 45.0
_POLL_ERRORS = (
    psycopg.Error,
    errors.StorageError,
    errors.ApprovalNotFoundError,
    errors.ApprovalOrphanedError,
    redis.RedisError,
    kombu.exceptions.OperationalError,
    OSError,
)


def _plan(config: SoakConfig, rng: random.Random) -> deque[tuple[float, str]]:
    """The faults in order, each due once that share of the runs was sent: infrastructure faults evenly
    spread and alternating Redis and Postgres, worker kills spread in between."""
    redis_kinds = [REDIS_LOST if n % 2 == 0 else REDIS_AOF for n in range(config.redis_restarts)]
    postgres_kinds = [POSTGRES] * config.postgres_restarts
    infra: list[str] = []
    while redis_kinds or postgres_kinds:
        infra += [kinds.pop(0) for kinds in (redis_kinds, postgres_kinds) if kinds]
    plan = [((n + 1) / (len(infra) + 1), kind) for n, kind in enumerate(infra)]
    step = 1 / (config.kills + 1)
    plan += [(step * (n + 1) + rng.uniform(-step / 3, step / 3), "kill") for n in range(config.kills)]
    return deque(sorted(plan))


@dataclass
class _Infra:
    """One Redis or Postgres restart: when it went down and answered again, and the runs under way then."""

    kind: str
    down_at: float
    back_at: float
    affected: tuple[str, ...]
    workers: tuple[Worker, ...]
    keys_before: int | None = None
    keys_at_start: int | None = None


@dataclass
class _Soak:
    cluster: SoakCluster
    postgres: PrivatePostgres
    redis_server: PrivateRedis
    config: SoakConfig
    rng: random.Random
    run_ids: list[str] = field(default_factory=list)
    gated: set[str] = field(default_factory=set)
    sent: int = 0
    #: Runs sent whose input is not all answered yet.
    active: set[str] = field(default_factory=set)
    finished_once: set[str] = field(default_factory=set)
    followed: set[str] = field(default_factory=set)
    #: Sends that failed (a server down), retried with the same idempotency key: applied once.
    unsent: list[tuple[str, str, str]] = field(default_factory=list)
    approvals: int = 0
    poll_errors: Counter[str] = field(default_factory=Counter)
    timeline: list[tuple[float, int]] = field(default_factory=list)
    memory: list[MemoryReading] = field(default_factory=list)
    kills: Counter[str] = field(default_factory=Counter)
    infra: list[_Infra] = field(default_factory=list)
    restarts: list[tuple[float, str]] = field(default_factory=list)
    plan: deque[tuple[float, str]] = field(default_factory=deque)
    quiet_until: float = 0.0
    settling: _Infra | None = None
    unready_since: float | None = None
    exits: list[WorkerExit] = field(default_factory=list)
    #: The I19 checker's looks seen (their times) and the most runs any of them found unexplained.
    doctor_looks: set[datetime] = field(default_factory=set)
    unexplained_max: int = 0
    unexplained_seen: list[tuple[datetime, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.run_ids = [f"soak-{n:05d}" for n in range(self.config.runs)]
        self.gated = set(self.rng.sample(self.run_ids, round(self.config.runs * self.config.gated_share)))
        self.plan = _plan(self.config, self.rng)

    # -- load --------------------------------------------------------------------------------

    def send(self, session_id: str, key: str, text: str) -> None:
        try:
            self.cluster.client.agent(AGENT).send(text, session_id=session_id, idempotency_key=key, check_agent=False)
        except _POLL_ERRORS as exc:
            self.poll_errors[f"send: {type(exc).__name__}"] += 1
            self.unsent.append((session_id, key, text))

    def arrivals_held(self) -> bool:
        """Sends stay at most ``in_flight`` runs ahead of a fault that waits for the cluster to heal."""
        return bool(self.plan) and self.sent >= self.plan[0][0] * self.config.runs + self.config.in_flight

    def poll(self, *, arrivals: bool = True) -> None:
        try:
            self._poll(arrivals)
        except _POLL_ERRORS as exc:
            self.poll_errors[type(exc).__name__] += 1

    def _poll(self, arrivals: bool) -> None:
        retry, self.unsent = self.unsent, []
        for args in retry:
            self.send(*args)
        with psycopg.connect(self.cluster.database_url, connect_timeout=3) as conn:
            rows = conn.execute(
                "SELECT session_id FROM runs WHERE session_id = ANY(%s) AND status = 'finished'"
                " AND inbox_cursor >= inbox_head",
                (sorted(self.active),),
            ).fetchall()
            self.read_doctor(conn)
        for (session_id,) in rows:
            self.active.discard(session_id)
            if session_id in self.finished_once:
                continue
            self.finished_once.add(session_id)
            self.timeline.append((time.time(), len(self.finished_once)))
            if self.rng.random() < self.config.follow_up_share:
                self.followed.add(session_id)
                self.active.add(session_id)
                self.send(session_id, f"{session_id}-2", _follow_up(session_id))
        self.approvals += self.cluster.approve_pending(AGENT)
        while (
            arrivals
            and self.sent < self.config.runs
            and len(self.active) < self.config.in_flight
            and not self.arrivals_held()
        ):
            session_id = self.run_ids[self.sent]
            shape = {"turns": self.config.turns, **RUN_SHAPE, **(GATE if session_id in self.gated else {})}
            self.sent += 1
            self.active.add(session_id)
            self.send(session_id, f"{session_id}-1", run_input(session_id, **shape))

    def read_doctor(self, conn: psycopg.Connection[Any]) -> None:
        """Note the checker's latest look: ``lousho_runs_unexplained`` must read 0 at every one (I19)."""
        look = conn.execute("SELECT looked_at, unexplained FROM doctor_looks WHERE name = 'i19'").fetchone()
        if look is not None and look[0] not in self.doctor_looks:
            self.doctor_looks.add(look[0])
            self.unexplained_max = max(self.unexplained_max, int(look[1]))
            if look[1]:
                self.unexplained_seen.append((look[0], int(look[1])))

    def read_memory(self) -> None:
        self.memory.append(read_memory(self.cluster.workers, len(self.finished_once)))

    # -- faults ------------------------------------------------------------------------------

    def whole(self) -> bool:
        """Whether both workers run and consume; fails when one stays unready with nobody killing it."""
        live = self.cluster.live_workers()
        if self.restarts:
            return False
        if len(live) == len(WORKERS) and all(w.ready() for w in live):
            self.unready_since = None
            return True
        self.unready_since = self.unready_since or time.monotonic()
        if time.monotonic() - self.unready_since > UNREADY_MAX_S:
            detail = {w.name: {"pid": w.pid, "pool": w.children()} for w in live}
            raise AssertionError(f"a worker is not ready after {UNREADY_MAX_S} s: {detail}")
        return False

    def settled(self) -> bool:
        """Whether every run the last restart hit saved since (or the wait is over)."""
        if self.settling is None:
            return True
        infra = self.settling
        if time.time() - infra.back_at > SETTLE_MAX_S:
            self.settling = None
            return True
        try:
            with psycopg.connect(self.cluster.database_url, connect_timeout=3) as conn:
                row = conn.execute(
                    "SELECT count(DISTINCT session_id) FROM checkpoint_history WHERE"
                    " session_id = ANY(%s) AND saved_at > to_timestamp(%s)",
                    (list(infra.affected), infra.back_at),
                ).fetchone()
        except psycopg.Error:
            return False
        if row is not None and row[0] >= len(infra.affected):
            self.settling = None
        return self.settling is None

    def maybe_fault(self) -> None:
        if not self.plan or self.sent < self.plan[0][0] * self.config.runs or time.monotonic() < self.quiet_until:
            return
        if not self.whole() or not self.settled():
            return
        _, kind = self.plan.popleft()
        if kind == "kill":
            self.kill_worker()
        else:
            self.restart_server(kind)
        self.quiet_until = time.monotonic() + GAP_S

    def kill_worker(self) -> None:
        worker = self.rng.choice(self.cluster.live_workers())
        roll = self.rng.random()
        action = KILL_ACTIONS[0] if roll < 0.5 else KILL_ACTIONS[1] if roll < 0.9 else KILL_ACTIONS[2]
        if action == "kill-child":
            holders = set(self.cluster.lease_holders().values())
            children = worker.children()
            self.cluster.kill_pid(self.rng.choice([pid for pid in children if pid in holders] or children))
        else:
            (self.cluster.kill_group if action == "kill-group" else self.cluster.kill_main)(worker)
            self.restarts.append((time.monotonic() + self.rng.uniform(0.5, 2.0), worker.name))
        self.kills[action] += 1

    def watch_workers(self) -> None:
        """Restart a worker or the beat that exited by itself, as its deployment would (``restart: unless-stopped``)."""
        for name in WORKERS:
            mine = [w for w in self.cluster.workers if w.name == name]
            if not mine or mine[-1].alive() or any(n == name for _, n in self.restarts):
                continue
            worker = mine[-1]
            self.exits.append(worker_exit(worker.name, worker.pid, worker.log_path))
            self.restarts.append((time.monotonic() + SUPERVISOR_DELAY_S, name))
        beats = self.cluster.beats
        if beats and beats[-1].poll() is not None:
            log_path = self.cluster.workdir / f"beat-{len(beats)}.log"
            self.exits.append(worker_exit("beat", beats[-1].pid, log_path))
            self.cluster.start_beat()

    def restart_due_workers(self, everyone: bool = False) -> None:
        now = time.monotonic()
        for due, name in [r for r in self.restarts if everyone or r[0] <= now]:
            self.restarts.remove((due, name))
            self.cluster.start_worker(name, concurrency=CONCURRENCY, wait=False)

    def under_way(self) -> tuple[str, ...]:
        """Runs with input not all answered that wait for no human."""
        with psycopg.connect(self.cluster.database_url, connect_timeout=3) as conn:
            rows = conn.execute(
                "SELECT session_id FROM runs WHERE session_id = ANY(%s) AND status <> 'awaiting-approval'",
                (sorted(self.active),),
            ).fetchall()
        return tuple(sorted(row[0] for row in rows))

    def restart_server(self, kind: str) -> None:
        affected, workers = self.under_way(), tuple(self.cluster.live_workers())
        keys_before = keys_at_start = None
        if kind == POSTGRES:
            down_at = self.postgres.crash()
            time.sleep(max(0.0, down_at + POSTGRES_DOWN_S - time.time()))
            back_at = self.postgres.start()
            pid = self.postgres.pid() or 0
        else:
            keys_before = self.redis_server.keys()
            down_at = self.redis_server.kill()
            if kind == REDIS_LOST:
                self.redis_server.wipe()
            time.sleep(REDIS_DOWN_S)
            later = [k for _, k in self.plan if k in (REDIS_LOST, REDIS_AOF)]
            # The append-only file is on from this restart when the next Redis kill is to replay it.
            back_at = self.redis_server.start(aof=kind == REDIS_AOF or later[:1] == [REDIS_AOF])
            keys_at_start = self.redis_server.keys_at_start
            if later[:1] == [REDIS_LOST] and self.redis_server.aof:
                self.redis_server.stop_appending()
            pid = self.redis_server.pid or 0
        record = _Infra(kind, down_at, back_at, affected, workers, keys_before, keys_at_start)
        self.infra.append(record)
        self.settling = record
        # Recovery from a restart counts from the server answering again.
        self.cluster.faults.append(checker.Fault(back_at, kind, (pid,), affected))

    # -- phases ------------------------------------------------------------------------------

    def load(self) -> float:
        """Send every run and do every fault; returns the seconds it took."""
        started = time.monotonic()
        next_poll = next_memory = 0.0
        while self.sent < self.config.runs or self.plan:
            if time.monotonic() - started > self.config.max_seconds:
                raise AssertionError(
                    f"the load took over {self.config.max_seconds} s: {self.sent} runs sent,"
                    f" {len(self.finished_once)} finished, faults left {list(self.plan)};"
                    f" runs under way: {self.stuck()}"
                )
            self.watch_workers()
            self.restart_due_workers()
            now = time.monotonic()
            if now >= next_poll:
                self.poll()
                next_poll = now + POLL_S
            if now >= next_memory:
                self.read_memory()
                next_memory = now + self.config.rss_every_s
            self.maybe_fault()
            time.sleep(0.05)
        return time.monotonic() - started

    def stuck(self) -> dict[str, Any]:
        """Status, seq, attempts, last error and lease holder of (at most 20 of) the runs under way."""
        found = self.cluster.statuses(sorted(self.active))
        holders = self.cluster.lease_holders()
        return {s: {**found.get(s, {"status": "missing"}), "lease": holders.get(s)} for s in sorted(self.active)[:20]}

    def drain(self) -> float:
        """Wait until every run answered all its input; returns the seconds it took."""
        self.restart_due_workers(everyone=True)
        started = time.monotonic()
        while self.active or self.unsent:
            if time.monotonic() - started > self.config.drain_s:
                raise AssertionError(
                    f"{len(self.active)} run(s) not finished {self.config.drain_s} s after the"
                    f" load: {self.stuck()}; unsent: {self.unsent[:5]}"
                )
            self.watch_workers()
            self.restart_due_workers()
            self.poll(arrivals=False)
            time.sleep(POLL_S)
        self.read_memory()
        return time.monotonic() - started


def _follow_up(session_id: str) -> str:
    return f"follow-up for {session_id}"


def _user_texts(cluster: SoakCluster, session_ids: set[str]) -> dict[str, list[str]]:
    """The user messages of each run's transcript (format 2 keeps them as rows)."""
    found: dict[str, list[str]] = {s: [] for s in session_ids}
    with psycopg.connect(cluster.database_url) as conn:
        for session_id, message in conn.execute(
            "SELECT session_id, message FROM run_messages WHERE session_id = ANY(%s) ORDER BY session_id, slot",
            (sorted(session_ids),),
        ):
            if message.get("role") == "user":
                found[session_id].append(str(message.get("content")))
    return found


def _recovery_budget(cluster: SoakCluster, config: SoakConfig) -> RecoveryBudget:
    """I11 (lease TTL + sweep + one step at this soak's step p99), plus the wait behind the other runs' steps
    (a re-sent step queues behind up to one step of each other run in flight) and scheduling noise."""
    steps = cluster.step_times()
    step_p50, step_p99 = checker.percentile(steps, 50) or 0.0, checker.percentile(steps, 99) or 0.0
    queued = math.ceil((config.in_flight - 1) / (len(WORKERS) * CONCURRENCY))
    return cluster.recovery_budget(step_p99, round(queued * step_p50 + LOADED_MACHINE_S, 3))


def _after_redis(soak: _Soak, ts: float) -> float | None:
    """Seconds from the Redis server answering again after its last kill before ``ts``, to ``ts`` (None: no kill)."""
    kills = [i for i in soak.infra if i.kind != POSTGRES and i.down_at <= ts]
    return round(ts - kills[-1].back_at, 3) if kills else None


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "p50_s": checker.percentile(values, 50),
        "p99_s": checker.percentile(values, 99),
        "max_s": round(max(values), 3) if values else None,
    }


def _restart_figures(soak: _Soak, logs: dict[Path, str], passes: list[SweepPass]) -> list[dict[str, Any]]:
    """Per Redis or Postgres restart: down time, runs hit, keys, runs the sweep sent in the 10 s after it, and
    each worker's first task received and first step saved after it (None: it was killed or exited before)."""
    figures = []
    for infra in soak.infra:
        workers = {}
        for worker in infra.workers:
            received = first_after(logs[worker.log_path], infra.back_at)
            killed = [
                f.ts - infra.back_at for f in soak.cluster.faults if worker.pid in f.pids and f.ts > infra.back_at
            ]
            killed += [e.ts - infra.back_at for e in soak.exits if e.pid == worker.pid and e.ts > infra.back_at]
            workers[f"{worker.name} (pid {worker.pid})"] = {
                "first_task_s": received,
                "first_save_s": first_after(logs[worker.log_path], infra.back_at, saved=True),
                "killed_after_s": round(min(killed), 3) if killed else None,
            }
        figures.append(
            {
                "kind": infra.kind,
                "down_s": round(infra.back_at - infra.down_at, 2),
                "runs_hit": len(infra.affected),
                "keys_before": infra.keys_before,
                "keys_at_start": infra.keys_at_start,
                "sweep_sent_within_10_s": sum(p.sent for p in passes if infra.back_at <= p.ts <= infra.back_at + 10),
                "workers": workers,
            }
        )
    return figures


def test_soak_loses_no_run_and_breaks_no_invariant_under_worker_redis_and_postgres_kills(
    soak_cluster: SoakCluster, private_postgres: PrivatePostgres, private_redis: PrivateRedis, soak_config: SoakConfig
) -> None:
    config = soak_config
    print(f"\nsoak: {config}")
    cluster = soak_cluster
    soak = _Soak(cluster, private_postgres, private_redis, config, random.Random(config.seed))
    for worker in [cluster.start_worker(name, concurrency=CONCURRENCY, wait=False) for name in WORKERS]:
        cluster.wait_ready(worker)
    cluster.start_beat()
    soak.read_memory()

    load_s = soak.load()
    drain_s = soak.drain()

    final_look = cluster.client.doctor()
    report = checker.check(cluster.database_url, cluster.log_path, expected=soak.run_ids, faults=cluster.faults)
    checker.print_report(
        {
            **report,
            "recovery": {
                **report["recovery"],
                "hit_again": {k: v for k, v in report["recovery"]["hit_again"].items() if k != "runs"},
            },
        },
        "soak",
    )
    violations = report["violations"]
    recovery = recovery_by_action(cluster.database_url, cluster.faults)
    logs = {w.log_path: w.log_path.read_text(errors="replace") for w in cluster.workers}
    passes = sweep_passes("".join(logs.values()))
    users = _user_texts(cluster, set(soak.run_ids))
    wrong_inputs = {
        s: texts
        for s, texts in users.items()
        if texts[1:] != ([_follow_up(s)] if s in soak.followed else []) or not texts
    }
    steps = cluster.step_times()
    budget = _recovery_budget(cluster, config)
    figures = {
        "seed": config.seed,
        "runs": config.runs,
        "finished": report["finished"],
        "follow_ups": len(soak.followed),
        "gated": len(soak.gated),
        "approvals": soak.approvals,
        "load_s": round(load_s, 1),
        "drain_s": round(drain_s, 1),
        "faults": {**soak.kills, **Counter(i.kind for i in soak.infra)},
        "kills_hitting_a_lease": sum(1 for f in cluster.faults if f.action in KILL_ACTIONS and f.runs),
        "recovery_by_fault": {kind: _summary(times) for kind, times in sorted(recovery.items())},
        "recovery_budget": str(budget),
        "restarts": _restart_figures(soak, logs, passes),
        "memory": memory_summary(soak.memory),
        "sweep": sweep_cost(passes, soak.timeline, config.runs),
        "steps": {
            "count": len(steps),
            "p50_s": checker.percentile(steps, 50),
            "p99_s": checker.percentile(steps, 99),
            "outcomes": dict(cluster.outcomes()),
        },
        "raw_reexecutions": report["raw_reexecutions"],
        "wasted_model_calls": report["wasted_model_calls"],
        "interrupted_results": report["interrupted_results"],
        "producer_errors": dict(soak.poll_errors),
        "worker_exits": [
            {"worker": f"{e.name} (pid {e.pid})", "reason": e.reason, "after_redis_restart_s": _after_redis(soak, e.ts)}
            for e in soak.exits
        ],
        "violations": len(violations),
        "doctor": {
            "looks_seen": len(soak.doctor_looks),
            "unexplained_max": soak.unexplained_max,
            "unexplained_at": [(at.isoformat(), n) for at, n in soak.unexplained_seen[:10]],
            "unexplained_after_drain": [f.summary.session_id for f in final_look.unexplained],
        },
    }
    (cluster.workdir / "soak-figures.json").write_text(json.dumps(figures, indent=2, default=str))
    print("\n== soak figures ==\n" + json.dumps(figures, indent=2, default=str))

    checker.assert_clean({"violations": violations})
    # I19: the checker looked throughout, through every kill and restart, and never found a run nothing moves.
    assert len(soak.doctor_looks) >= 3, f"the I19 checker hardly looked: {figures['doctor']}"
    assert soak.unexplained_max == 0 and not final_look.unexplained, f"unexplained runs: {figures['doctor']}"
    assert report["finished"] == config.runs
    assert not wrong_inputs, f"inputs not applied exactly once: {dict(list(wrong_inputs.items())[:5])}"
    # Every fault of the plan was done, and they hit work in flight (else the soak proves nothing).
    assert sum(soak.kills.values()) == config.kills and not soak.plan
    assert figures["kills_hitting_a_lease"] >= config.kills // 2, "most kills hit no lease holder"
    assert Counter(i.kind for i in soak.infra) == Counter(k for _, k in _plan(config, random.Random(0)) if k != "kill")
    for infra in soak.infra:
        assert infra.affected, f"{infra.kind} hit no run"
    # A worker exits by itself only in the known way: losing the broker mid-ack when Redis is killed.
    for exited in figures["worker_exits"]:
        after = exited["after_redis_restart_s"]
        assert after is not None and after <= EXIT_AFTER_REDIS_S, f"a worker exited by itself: {exited}"
    for kind, times in recovery.items():
        assert (checker.percentile(times, 99) or 0.0) <= budget.limit_s, f"{kind}: recovery p99 over {budget}"
    for restart in figures["restarts"]:
        if restart["kind"] == REDIS_LOST:
            assert restart["keys_at_start"] == 0 < restart["keys_before"], restart
        if restart["kind"] == REDIS_AOF:
            assert restart["keys_at_start"] > 0, f"the append-only file replayed nothing: {restart}"
        # RELIABILITY P6: every worker takes tasks again after a restart (unless it was killed first).
        for name, seen in restart["workers"].items():
            first, killed = seen["first_task_s"], seen["killed_after_s"]
            if killed is not None and killed <= CONSUME_WITHIN_S and (first is None or killed < first):
                continue
            assert first is not None and first <= CONSUME_WITHIN_S, (name, restart)
