"""The soak's size, its private servers and its readings: a ``redis-server`` it kills, worker memory, sweep times.

``SoakConfig`` reads the size from the environment once (the defaults are the short form CI runs):

``LOUSHO_SOAK_RUNS``               runs (40; 2000 for the long soak)
``LOUSHO_SOAK_SECONDS``            the longest the load may take before the drain (derived from the runs)
``LOUSHO_SOAK_KILLS``              worker kills (6, or one per 35 runs when more)
``LOUSHO_SOAK_REDIS_RESTARTS``     Redis kills, alternating lost data and AOF replay (2)
``LOUSHO_SOAK_POSTGRES_RESTARTS``  Postgres immediate stops (1 up to 100 runs, else 2)
``LOUSHO_SOAK_IN_FLIGHT``          runs under way at once (12)
``LOUSHO_SOAK_TURNS``              model turns per run (8 up to 500 runs, else 4: the faults, paced by the
                                   cluster healing after each, then spread over the whole load)
``LOUSHO_SOAK_SEED``               replays a soak's choices (random)

``PrivateRedis`` runs this machine's ``redis-server`` (else the one the embedded services use) on a
free port of 127.0.0.1, in a folder of its own, never the machine's Redis. It starts without
persistence (``--save "" --appendonly no``: a kill loses every key) or with the append-only file
(``--appendonly yes --appendfsync everysec``: a restart replays it, losing at most the last second),
and ``kill`` SIGKILLs it the way a crash does. ``SoakCluster`` is a ``Cluster`` whose workers, beat,
producer, lease readings and checks all use a private Postgres and a private Redis.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import redis

from devkit.embedded import processes
from devkit.embedded.redis_server import redis_server_binary
from producer.client import Client
from tests.support import checker, services
from tests.support.cluster import Cluster, Worker

_STAMP = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+): \w+/[^\]]+\] "
#: A sweep the worker finished (Celery's success line, the number of runs it sent as the value).
_SWEEP_DONE = re.compile(_STAMP + r"Task lousho\.recover\[[0-9a-f-]+\] succeeded in ([0-9.e-]+)s: (\d+)")
#: A step message a worker took from the broker.
_RECEIVED = re.compile(_STAMP + r"Task \S+\[[0-9a-f-]+\] received")
#: A step that saved something.
_SAVED = re.compile(_STAMP + r"advance \S+ seq=\S+ -> (?:advanced|finished|awaiting-approval)")


@dataclass(frozen=True)
class SoakConfig:
    """How big one soak is and which faults it does."""

    runs: int
    seed: int
    max_seconds: float
    kills: int
    redis_restarts: int
    postgres_restarts: int
    in_flight: int
    #: Model turns per run: a run of N turns takes about (2N - 1) x 0.35 s of a pool process.
    turns: int
    #: Share of runs with an approval-gated call, and of finished runs that get a follow-up.
    gated_share: float = 0.15
    follow_up_share: float = 0.2
    #: Every run must be finished this long after the load ends.
    drain_s: float = 90.0
    #: How often the workers' memory is read.
    rss_every_s: float = 5.0

    @classmethod
    def from_env(cls) -> SoakConfig:
        """The soak's size from ``LOUSHO_SOAK_*`` (see the module docstring)."""
        runs = int(os.environ.get("LOUSHO_SOAK_RUNS", "40"))

        def number(name: str, default: float) -> float:
            return float(os.environ.get(f"LOUSHO_SOAK_{name}") or default)

        # About 1.2 s of a loaded 2-core machine per run with the faults, plus the servers' start.
        seconds = number("SECONDS", 100 + 1.2 * runs)
        return cls(
            runs=runs,
            seed=int(number("SEED", random.randrange(1 << 30))),
            max_seconds=seconds,
            kills=int(number("KILLS", max(6, runs // 35))),
            redis_restarts=int(number("REDIS_RESTARTS", 2)),
            postgres_restarts=int(number("POSTGRES_RESTARTS", 1 if runs <= 100 else 2)),
            in_flight=int(number("IN_FLIGHT", 12)),
            turns=int(number("TURNS", 8 if runs <= 500 else 4)),
            rss_every_s=max(5.0, min(30.0, seconds / 60)),
        )

    @property
    def timeout_s(self) -> float:
        """pytest-timeout for the whole test: the load, the drain, the checks and the servers' start."""
        return self.max_seconds + self.drain_s + 120 + self.runs * 0.05


CONFIG = SoakConfig.from_env()


def log_time(stamp: str) -> float:
    """Epoch seconds of a worker log stamp (the ``logging`` module writes local time)."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


class PrivateRedis:
    """One throwaway ``redis-server`` in ``home`` on a fixed free port; ``kill`` and ``start`` keep the port."""

    def __init__(self, home: Path, startup_timeout: float = 20.0) -> None:
        """Describe the server of ``home``; nothing runs until ``start``."""
        self.home = home
        self.log_path = home / "redis.log"
        self.startup_timeout = startup_timeout
        self.port = processes.pick_port()
        self.aof = False
        #: Keys in database 0 at the first answer of the last start (0 when nothing was replayed).
        self.keys_at_start = 0
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        """The URL of database ``db`` on this server."""
        return f"redis://{processes.HOST}:{self.port}/{db}"

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs."""
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def start(self, *, aof: bool) -> float:
        """Start the server (with the append-only file when ``aof``) and wait until it answers PING.

        With ``aof`` a server killed while it also ran with the file finds its keys again; without it
        the server starts empty whatever the folder holds.

        Returns:
            When the server first answered (epoch seconds).
        """
        if self.pid is not None:
            raise RuntimeError("the private Redis already runs")
        binary = shutil.which("redis-server") or str(redis_server_binary())
        self.home.mkdir(parents=True, exist_ok=True)
        persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if aof else ["--appendonly", "no"]
        args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            processes.HOST,
            "--protected-mode",
            "yes",
            "--dir",
            str(self.home),
            "--save",
            "",
            *persistence,
            "--maxmemory-policy",
            "noeviction",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.aof = aof
        client = redis.Redis.from_url(self.url(), socket_timeout=2, socket_connect_timeout=2)
        deadline = time.monotonic() + self.startup_timeout
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}:\n{self.log_tail()}")
                with contextlib.suppress(redis.RedisError):  # refused, or still loading the append-only file
                    if client.ping():
                        answered = time.time()
                        self.keys_at_start = int(client.dbsize())
                        return answered
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer in {self.startup_timeout} s:\n{self.log_tail()}")
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> float:
        """SIGKILL the server and reap it: nothing is flushed, no client is told.

        Returns:
            When the signal was sent (epoch seconds).
        """
        process = self.process
        if process is None or process.poll() is not None:
            raise RuntimeError("the private Redis is not running")
        killed_at = time.time()
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        return killed_at

    def wipe(self) -> None:
        """Delete the persistence files of a stopped server: its next start finds nothing to replay."""
        if self.pid is not None:
            raise RuntimeError("the private Redis runs")
        shutil.rmtree(self.home / "appendonlydir", ignore_errors=True)
        for name in ("appendonly.aof", "dump.rdb"):
            (self.home / name).unlink(missing_ok=True)

    def stop_appending(self) -> None:
        """Turn the append-only file off on the running server (its next kill loses every key, once wiped)."""
        client = redis.Redis.from_url(self.url(), socket_timeout=5, socket_connect_timeout=2)
        try:
            client.config_set("appendonly", "no")
        finally:
            client.close()
        self.aof = False

    def keys(self) -> int:
        """How many keys database 0 holds now."""
        client = redis.Redis.from_url(self.url(), socket_timeout=2, socket_connect_timeout=2)
        try:
            return int(client.dbsize())
        finally:
            client.close()

    def log_tail(self, lines: int = 20) -> str:
        """The end of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    def close(self) -> None:
        """Kill the server if it runs (its data is thrown away)."""
        if self.pid is not None:
            self.kill()


class SoakCluster(Cluster):
    """A ``Cluster`` whose processes, producer, lease readings and checks use the private servers of ``extra_env``."""

    @property
    def database_url(self) -> str:
        """The private Postgres's test database."""
        return self.extra_env["LOUSHO_DATABASE_URL"]

    @property
    def redis_url(self) -> str:
        """The private Redis (broker and leases)."""
        return self.extra_env["LOUSHO_REDIS_URL"]

    @property
    def client(self) -> Client:
        """A producer on the private servers."""
        if self._client is None:
            self._client = Client(services.test_settings(database_url=self.database_url, redis_url=self.redis_url))
        return self._client

    @property
    def redis(self) -> redis.Redis:
        """A client of the private Redis, with short timeouts (the server is killed on purpose)."""
        if self._redis is None:
            self._redis = redis.Redis.from_url(self.redis_url, socket_timeout=3, socket_connect_timeout=3)
        return self._redis


@dataclass(frozen=True)
class MemoryReading:
    """Resident memory of the workers' processes at one moment, in KiB, with the runs finished by then."""

    ts: float
    finished: int
    #: Worker name -> main process VmRSS.
    main_kib: dict[str, int]
    #: Pool process pid -> VmRSS.
    pool_kib: dict[int, int]


def vm_rss_kib(pid: int) -> int | None:
    """A process's ``VmRSS`` from /proc, None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_memory(workers: list[Worker], finished: int) -> MemoryReading:
    """The live workers' main and pool processes' ``VmRSS`` now."""
    main: dict[str, int] = {}
    pool: dict[int, int] = {}
    for worker in workers:
        if not worker.alive():
            continue
        rss = vm_rss_kib(worker.pid)
        if rss is not None:
            main[worker.name] = rss
        for child in worker.children():
            rss = vm_rss_kib(child)
            if rss is not None:
                pool[child] = rss
    return MemoryReading(time.time(), finished, main, pool)


@dataclass(frozen=True)
class WorkerExit:
    """A worker main process that exited without being killed: when it last logged, and why."""

    name: str
    pid: int
    ts: float
    reason: str


_CRITICAL = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+): CRITICAL/MainProcess\] (.*)")


def worker_exit(name: str, pid: int, log_path: Path) -> WorkerExit:
    """What a worker (or beat) that exited by itself last said: its last CRITICAL line (else its last line), and when.

    The one seen so far: the broker connection is lost (Redis killed) while an ack or a reject is under
    way, and closing the channel raises ``AttributeError: 'NoneType' object has no attribute 'hostname'``
    in kombu's ``_connparams``, which Celery treats as unrecoverable (kombu#970, kombu#582).
    """
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    critical = _CRITICAL.findall(text)
    stamps = re.findall(_STAMP, text)
    lines = text.strip().splitlines()
    reason = critical[-1][1] if critical else (lines[-1] if lines else "(empty log)")
    return WorkerExit(name, pid, log_time(stamps[-1]) if stamps else time.time(), reason[:200])


@dataclass(frozen=True)
class SweepPass:
    """One ``lousho.recover`` pass a worker finished: when, how long it took, how many runs it sent."""

    ts: float
    seconds: float
    sent: int


def sweep_passes(log_text: str) -> list[SweepPass]:
    """Every sweep pass in the workers' logs, in time order."""
    return sorted(
        (SweepPass(log_time(m.group(1)), float(m.group(2)), int(m.group(3))) for m in _SWEEP_DONE.finditer(log_text)),
        key=lambda p: p.ts,
    )


def first_after(log_text: str, since: float, *, saved: bool = False) -> float | None:
    """Seconds from ``since`` to the first task a worker log shows received (``saved``: the first step that
    saved) after it; None when there was none."""
    for match in (_SAVED if saved else _RECEIVED).finditer(log_text):
        at = log_time(match.group(1))
        if at >= since:
            return round(at - since, 3)
    return None


def recovery_by_action(database_url: str, faults: Sequence[checker.Fault]) -> dict[str, list[float]]:
    """Recovery times (``checker.Episode.since_last_s``) of every run, grouped by the last fault that touched it."""
    saves: dict[str, list[float]] = defaultdict(list)
    with psycopg.connect(database_url) as conn:
        for session_id, saved_at in conn.execute(
            "SELECT session_id, extract(epoch FROM saved_at)::float8 FROM checkpoint_history"
        ):
            saves[session_id].append(saved_at)
    found: dict[str, list[float]] = defaultdict(list)
    for session_id, times in saves.items():
        for episode in checker.recovery_episodes(session_id, times, faults):
            if episode.progress_at is not None:
                found[episode.faults[-1].action].append(episode.since_last_s)
    return dict(found)


def _mib(kib: float) -> float:
    return round(kib / 1024, 1)


def memory_summary(readings: Sequence[MemoryReading]) -> dict[str, Any]:
    """Pool and main processes' ``VmRSS`` at the first and the last reading, at about ten readings in between
    (``trend``), and the longest-lived pool process's.

    Kills replace processes all along: the pool figures are over whatever processes were alive at each
    reading; the longest-lived one shows the growth of one process over the most work.
    """
    first, last = readings[0], readings[-1]

    def side(reading: MemoryReading) -> dict[str, Any]:
        pool = sorted(reading.pool_kib.values())
        return {
            "finished": reading.finished,
            "pool_mib_median": _mib(pool[len(pool) // 2]) if pool else None,
            "pool_mib_max": _mib(pool[-1]) if pool else None,
            "main_mib": {name: _mib(kib) for name, kib in sorted(reading.main_kib.items())},
        }

    seen: dict[int, list[tuple[MemoryReading, int]]] = defaultdict(list)
    for reading in readings:
        for pid, kib in reading.pool_kib.items():
            seen[pid].append((reading, kib))
    longest = max(seen.values(), key=lambda s: s[-1][0].ts - s[0][0].ts, default=[])
    lived = None
    if len(longest) >= 2:
        (start, start_kib), (end, end_kib) = longest[0], longest[-1]
        lived = {
            "seconds": round(end.ts - start.ts),
            "finished_from": start.finished,
            "finished_to": end.finished,
            "mib_from": _mib(start_kib),
            "mib_to": _mib(end_kib),
        }
    step = max(1, (len(readings) - 1) // 8)
    trend = [{"minute": round((r.ts - first.ts) / 60, 1), **side(r)} for r in [*readings[:-1:step], last]]
    return {
        "readings": len(readings),
        "start": side(first),
        "end": side(last),
        "longest_lived_pool": lived,
        "trend": trend,
    }


def sweep_cost(
    passes: Sequence[SweepPass], timeline: Sequence[tuple[float, int]], runs: int, buckets: int = 5
) -> list[dict[str, Any]]:
    """Sweep pass times, by how many runs had finished when the pass ran (``buckets`` equal slices of ``runs``).

    ``timeline`` holds (epoch seconds, runs finished by then), in time order. Passes that sent nothing
    time the scan alone; ``us_per_finished_run`` divides their median by the runs finished by then.
    """
    stamps = [ts for ts, _ in timeline]
    grouped: dict[int, list[SweepPass]] = defaultdict(list)
    finished_at: dict[int, list[int]] = defaultdict(list)
    for sweep in passes:
        index = bisect.bisect_right(stamps, sweep.ts) - 1
        finished = timeline[index][1] if index >= 0 else 0
        bucket = min(buckets - 1, finished * buckets // max(runs, 1))
        grouped[bucket].append(sweep)
        finished_at[bucket].append(finished)
    rows = []
    for bucket in sorted(grouped):
        times = [p.seconds * 1000 for p in grouped[bucket]]
        idle = [p.seconds * 1000 for p in grouped[bucket] if p.sent == 0]
        mean_finished = sum(finished_at[bucket]) / len(finished_at[bucket])
        idle_p50 = checker.percentile(idle, 50)
        rows.append(
            {
                "finished": f"{bucket * runs // buckets}-{(bucket + 1) * runs // buckets}",
                "passes": len(times),
                "p50_ms": checker.percentile(times, 50),
                "p99_ms": checker.percentile(times, 99),
                "idle_p50_ms": idle_p50,
                "sent": sum(p.sent for p in grouped[bucket]),
                "us_per_finished_run": round(idle_p50 * 1000 / mean_finished, 1)
                if idle_p50 and mean_finished
                else None,
            }
        )
    return rows
