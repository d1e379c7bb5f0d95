"""Real ``celery worker`` and ``celery beat`` subprocesses for the crash tests, and the faults done to them.

Each worker runs in its own session (process group) so a test can SIGKILL the whole group at once.
Every fault is recorded as a ``checker.Fault`` (time, victims, runs whose lease they held, runs whose
step message a killed worker held) for the recovery figures; ``Cluster.close`` kills every process
started here, whatever the test did.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import redis
from psycopg import sql

from producer.client import Client
from store import keys, owners
from store.inputs import normalize_input
from store.records import Checkpoint
from store.settings import Settings
from tests.support import services
from tests.support.checker import LOG_ENV, Fault, prepare_once_sink, read_log

ROOT = Path(__file__).resolve().parents[2]
AGENTS_MODULE = "tests.support.agents"
_MTIME_SLACK_S = 0.02
_LOG_LINE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+): \w+/([^\]]+)\] (.*)")
_OUTCOME = re.compile(r"advance (\S+) seq=(\S+) -> ([\w-]+)")
#: A step's task name: ``lousho.advance``, or the name it was sent under (``"<agent>: <kind>"``).
_STEP = r"(?:lousho\.advance|[A-Za-z0-9_.-]+: [a-z -]+)"
_STEP_TIME = re.compile(rf"Task {_STEP}\[[0-9a-f-]+\] succeeded in ([0-9.]+)s")
#: A step task's result when it took more than one step of its run (``StepReport.summary``).
_CHAINED = re.compile(r"(\d+) steps in one task")
_SWEEP_SENT = re.compile(r"Sending due task lousho-recover ")
_SWEEP_RECEIVED = re.compile(r"Task lousho\.recover\[[0-9a-f-]+\] received")
_RECEIVED = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+): \w+/MainProcess\]"
    rf" Task {_STEP}\[([0-9a-f-]+)\] received"
)
#: The hash where kombu's Redis transport keeps delivered, unacked messages (``Channel.unacked_key``).
_UNACKED_KEY = "unacked"
#: Crash points of ``worker/steps.py`` (each writes ``crash-<point>-<run>`` when it fires).
CRASH_POINTS = (
    "after_lease_before_epoch",
    "during_model_call",
    "after_model_response_before_save",
    "after_model_save_before_enqueue",
    "tool_before_effect",
    "after_tool_effect_before_result_save",
    "between_results",
    "after_batch_save_before_enqueue",
    "after_enqueue_before_ack",
)
#: Crash points around an approved call (``worker/batch.py``): they fire only once a human said yes.
APPROVAL_CRASH_POINTS = ("after_started_marker_before_approved_call", "after_approved_effect_before_result_save")
#: Crash points around the started mark of a ``once`` call (``worker/batch.py``; the first also fires before an
#: approved call's mark).
ONCE_CRASH_POINTS = (
    "before_started_marker",
    "after_started_marker_before_once_call",
    "after_once_effect_before_result_save",
)
#: Between a run's ``on_run_end`` hooks and the note that they ran (``worker/steps.py``).
END_HOOK_CRASH_POINTS = ("after_end_hooks_before_note",)
#: Between two steps one task takes in a row (``LOUSHO_CONTINUE_STEPS`` above 1; ``worker/steps.py``).
CHAIN_CRASH_POINTS = ("between_chained_steps",)


def _celery() -> str:
    beside = Path(sys.executable).with_name("celery")
    found = str(beside) if beside.exists() else shutil.which("celery")
    if not found:
        raise RuntimeError("the celery command is not installed")
    return found


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of a process from /proc, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may contain spaces or parentheses: the fields resume after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def _processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent pid, process group) of every process."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                found.append((int(entry.name), *stat))
    return found


def _children(pid: int) -> list[int]:
    """Live direct children of ``pid`` (prefork pool processes)."""
    return sorted(child for child, state, parent, _ in _processes() if parent == pid and state != "Z")


def _group_members(pgid: int) -> list[int]:
    """Live members of a process group."""
    return [pid for pid, state, _, group in _processes() if group == pgid and state != "Z"]


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


@dataclass(frozen=True)
class RecoveryBudget:
    """How soon a run hit by a fault must make progress again (RELIABILITY I11), from the settings.

    The bound is lease TTL + sweep interval + one step: the victim's lease expires at most a TTL
    after the fault (the run's last save is older still, so the sweep finds it stale by then), the
    beat sends the next sweep within an interval, and the re-sent step saves after its own work.
    ``slack_s`` is what the test allows on top on a loaded 2-core machine, each test saying why.
    """

    lease_ttl_s: float
    sweep_s: float
    step_s: float
    slack_s: float

    @property
    def bound_s(self) -> float:
        """I11: lease TTL + sweep interval + one step."""
        return round(self.lease_ttl_s + self.sweep_s + self.step_s, 3)

    @property
    def limit_s(self) -> float:
        """The bound plus the slack: a recovery slower than this fails the test."""
        return round(self.bound_s + self.slack_s, 3)

    def __str__(self) -> str:
        return (
            f"{self.limit_s} s (TTL {self.lease_ttl_s} + sweep {self.sweep_s} + step {self.step_s}"
            f" = {self.bound_s} s, + slack {self.slack_s} s)"
        )


@dataclass
class Worker:
    """One ``celery worker`` process group."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    concurrency: int
    announced: bool = False

    @property
    def pid(self) -> int:
        """The main process (also the process group id)."""
        return self.process.pid

    def children(self) -> list[int]:
        """Live pool processes."""
        return _children(self.pid)

    def alive(self) -> bool:
        """Whether the main process still runs."""
        return self.process.poll() is None

    def ready(self) -> bool:
        """Whether it consumes: alive, its pool complete, and its log said ``ready.`` once."""
        if not self.alive() or len(self.children()) < self.concurrency:
            return False
        if not self.announced:
            self.announced = " ready." in self.log_path.read_text(errors="replace")
        return self.announced


@dataclass
class Cluster:
    """Workers, a beat and a producer on the test services, plus the faults a test does to them."""

    workdir: Path
    crash_at: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)
    beats: list[subprocess.Popen[bytes]] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    _client: Client | None = None
    _redis: redis.Redis | None = None
    _starts: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.crash_dir.mkdir(exist_ok=True)
        prepare_once_sink(self.database_url)  # the once tools' effects (I18), empty for each cluster

    # -- paths and environment -------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        """The JSONL side-effect log the agents write."""
        return self.workdir / "events.jsonl"

    @property
    def crash_dir(self) -> Path:
        """Where crash points leave their ``crash-<point>-<run>`` markers."""
        return self.workdir / "crash"

    @property
    def database_url(self) -> str:
        """The test database the workers write to."""
        return services.test_database_url()

    def env(self) -> dict[str, str]:
        """The environment of every subprocess: the test services, CI timing, the test agents."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("LOUSHO_")}
        base.update(services.test_environment())
        base.update(
            {
                "LOUSHO_AGENTS": AGENTS_MODULE,
                LOG_ENV: str(self.log_path),
                "LOUSHO_CRASH_DIR": str(self.crash_dir),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.crash_at:
            base["LOUSHO_CRASH_AT"] = self.crash_at
        base.update(self.extra_env)
        return base

    def settings(self) -> Settings:
        """The settings the workers and the beat run with (``env()``, ``extra_env`` included)."""
        prefix = "LOUSHO_"
        return Settings.model_validate(
            {name[len(prefix) :].lower(): value for name, value in self.env().items() if name.startswith(prefix)}
        )

    def recovery_budget(self, step_s: float, slack_s: float) -> RecoveryBudget:
        """I11's bound for this cluster's settings and a step of ``step_s``, plus ``slack_s``."""
        settings = self.settings()
        return RecoveryBudget(settings.lease_ttl_ms / 1000, settings.recover_interval_s, step_s, slack_s)

    # -- processes ---------------------------------------------------------------------------

    def _spawn(self, args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                args,
                cwd=ROOT,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_worker(
        self,
        name: str = "w1",
        concurrency: int = 2,
        *,
        wait: bool = True,
        app: str = "worker",
        queues: str | None = None,
    ) -> Worker:
        """Start ``celery -A <app> worker`` (prefork) as a new process group, on ``queues`` (``-Q``) when given."""
        self._starts[name] += 1
        log_path = self.workdir / f"{name}.{self._starts[name]}.log"
        args = [
            _celery(),
            "-A",
            app,
            "worker",
            *(["-Q", queues] if queues else []),
            "-P",
            "prefork",
            "-c",
            str(concurrency),
            "-n",
            f"{name}-{self._starts[name]}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "info",
        ]
        worker = Worker(name, self._spawn(args, log_path), log_path, concurrency)
        self.workers.append(worker)
        if wait:
            self.wait_ready(worker)
        return worker

    def wait_ready(self, worker: Worker, timeout: float = 30.0) -> None:
        """Block until the worker consumes and its pool processes exist."""

        def ready() -> bool:
            if not worker.alive():
                raise AssertionError(f"worker {worker.name} exited: {self.tail(worker.log_path)}")
            return worker.ready()

        wait_until(ready, timeout, f"worker {worker.name} ready")

    def start_beat(self, app: str = "worker") -> subprocess.Popen[bytes]:
        """Start ``celery -A <app> beat`` with its own schedule file (``worker``'s only sends the sweeps)."""
        index = len(self.beats) + 1
        args = [
            _celery(),
            "-A",
            app,
            "beat",
            "-s",
            str(self.workdir / f"beat-{index}-schedule"),
            "--pidfile",
            str(self.workdir / f"beat-{index}.pid"),
            "-l",
            "info",
        ]
        beat = self._spawn(args, self.workdir / f"beat-{index}.log")
        self.beats.append(beat)
        return beat

    def live_workers(self) -> list[Worker]:
        """Workers whose main process runs."""
        return [w for w in self.workers if w.alive()]

    # -- leases and faults -------------------------------------------------------------------

    @property
    def redis(self) -> redis.Redis:
        """A client of the test Redis db (leases)."""
        if self._redis is None:
            self._redis = redis.Redis.from_url(services.test_redis_url())
        return self._redis

    def lease_holders(self) -> dict[str, int]:
        """Run id -> pid of the process whose live lease names it (``store.owners``)."""
        holders = {}
        for key in self.redis.scan_iter(match=keys.LEASE_PREFIX + "*", count=500):
            value = self.redis.get(key)
            if not isinstance(value, bytes):
                continue
            owner = owners.parse(value.decode())
            if owner is not None:
                holders[key.decode()[len(keys.LEASE_PREFIX) :]] = owner.pid
        return holders

    def holder_pid(self, session_id: str) -> int | None:
        """The pid holding the run's lease now, if any."""
        return self.lease_holders().get(session_id)

    def carried_runs(self, worker: Worker) -> set[str]:
        """Runs whose step message ``worker`` received and never acked (waiting for a pool process or running).

        The broker keeps each delivered message in its ``unacked`` hash until the ack; the workers'
        logs name each task they received. A message requeued after its pool process died keeps its
        task id, so a task belongs to the worker that received it last. Read after a whole worker
        was killed, these are the step messages that died with it.
        """
        last: dict[str, tuple[str, Worker]] = {}
        for candidate in self.workers:
            for stamp, task_id in _RECEIVED.findall(candidate.log_path.read_text(errors="replace")):
                if task_id not in last or stamp >= last[task_id][0]:
                    last[task_id] = (stamp, candidate)
        carried = set()
        for raw in self.redis.hvals(_UNACKED_KEY):
            payload = json.loads(raw)[0]
            task_id = payload["headers"].get("id")
            if payload["headers"].get("task") == "lousho.advance" and task_id in last and last[task_id][1] is worker:
                args, kwargs = json.loads(base64.b64decode(payload["body"]))[:2]
                carried.add(str(kwargs["session_id"] if "session_id" in kwargs else args[0]))
        return carried

    def _record(
        self, action: str, pids: Sequence[int], deliver: Callable[[], None], worker: Worker | None = None
    ) -> Fault:
        holders = self.lease_holders()
        ts = time.time()
        deliver()
        # A victim's lease outlives it by up to the TTL: reading again catches one taken in the
        # milliseconds between the first read and the kill.
        held = {s for s, p in [*holders.items(), *self.lease_holders().items()] if p in pids}
        carried = self.carried_runs(worker) - held if worker is not None else set()
        fault = Fault(ts, action, tuple(pids), tuple(sorted(held)), tuple(sorted(carried)))
        self.faults.append(fault)
        with open(self.workdir / "faults.jsonl", "a") as record:
            record.write(json.dumps(fault.to_json()) + "\n")
        return fault

    def kill_pid(self, pid: int, action: str = "kill-child") -> Fault:
        """SIGKILL one process (a pool child: the worker requeues its message and forks a new child)."""
        return self._record(action, [pid], lambda: os.kill(pid, signal.SIGKILL))

    def kill_group(self, worker: Worker) -> Fault:
        """SIGKILL the worker's whole process group: nothing is acked or rejected."""

        def kill() -> None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.process.wait(timeout=10)

        return self._record("kill-group", [worker.pid, *worker.children()], kill, worker)

    def kill_main(self, worker: Worker) -> Fault:
        """SIGKILL only the main process; its pool children die with it (Celery sets PDEATHSIG)."""

        def kill() -> None:
            os.kill(worker.pid, signal.SIGKILL)
            worker.process.wait(timeout=10)

        return self._record("kill-main", [worker.pid, *worker.children()], kill, worker)

    def stop(self, pid: int) -> Fault:
        """SIGSTOP one process (it keeps its lease value but stops renewing it)."""
        return self._record("stop", [pid], lambda: os.kill(pid, signal.SIGSTOP))

    def resume(self, pid: int) -> None:
        """SIGCONT a stopped process."""
        os.kill(pid, signal.SIGCONT)

    def crash_faults(self) -> list[Fault]:
        """Faults from the crash-point markers (the marker holds the pid, its mtime the time).

        File times come from the kernel's coarse clock, a few ms behind ``time.time()``; without
        the slack, a save made just before the crash would count as the recovery.
        """
        found = []
        for marker in sorted(self.crash_dir.glob("crash-*")):
            point, session_id = _split_marker(marker.name)
            text = marker.read_text().strip()
            found.append(
                Fault(
                    marker.stat().st_mtime + _MTIME_SLACK_S,
                    f"crash:{point}",
                    (int(text),) if text else (),
                    (session_id,),
                )
            )
        return found

    # -- runs ---------------------------------------------------------------------------------

    @property
    def client(self) -> Client:
        """A producer on the test services."""
        if self._client is None:
            self._client = Client(services.test_settings())
        return self._client

    def send(self, agent: str, session_id: str, text: str, *, seq: int | None = None) -> None:
        """Start a run: input durable in Postgres, then one ``advance`` message.

        With ``seq`` the message carries that seq (``Client.send`` sends none), so a redelivered
        copy is dropped as stale once the run moved past it.
        """
        if seq is None:
            self.client.agent(agent).send(text, session_id=session_id, check_agent=False)
            return
        self.client.store.append_input(session_id, agent, normalize_input(text))
        self.client.enqueuer.advance(session_id, seq)

    def statuses(self, session_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Run id -> status, seq, attempts and last error, straight from Postgres."""
        with psycopg.connect(self.database_url) as conn:
            rows = conn.execute(
                "SELECT session_id, status, seq, attempts, last_error FROM runs WHERE session_id = ANY(%s)",
                (list(session_ids),),
            ).fetchall()
        return {r[0]: {"status": r[1], "seq": r[2], "attempts": r[3], "last_error": r[4]} for r in rows}

    def approve_pending(self, agent: str) -> int:
        """Approve every undecided approval of ``agent``'s runs; returns how many."""
        approvals = self.client.agent(agent).approvals
        pending = approvals.list()
        for approval in pending:
            approvals.resolve(approval.approval_id, approved=True)
        return len(pending)

    def wait_finished(
        self, session_ids: Sequence[str], timeout: float = 60.0, on_poll: Callable[[], object] | None = None
    ) -> float:
        """Block until every run is finished; returns the seconds waited, fails with a diagnosis.

        ``on_poll`` runs at every poll (to approve gated calls as they come, for instance).
        """
        started = time.monotonic()
        while True:
            if on_poll is not None:
                on_poll()
            found = self.statuses(session_ids)
            waiting = [s for s in session_ids if found.get(s, {}).get("status") != "finished"]
            if not waiting:
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                holders = self.lease_holders()
                detail = {s: {**found.get(s, {"status": "missing"}), "lease": holders.get(s)} for s in waiting}
                raise AssertionError(f"{len(waiting)} run(s) not finished after {timeout} s: {detail}")
            time.sleep(0.1)

    def events(self) -> list[dict[str, Any]]:
        """The side-effect log so far."""
        return read_log(self.log_path)

    def checkpoint(self, agent: str, session_id: str) -> Checkpoint:
        """The run's stored checkpoint (it must exist)."""
        checkpoint = self.client.agent(agent).load(session_id)
        assert checkpoint is not None, f"run {session_id} is not stored"
        return checkpoint

    def call_starts(self, session_id: str) -> Counter[str]:
        """How many times each call of the run started executing (from the side-effect log)."""
        return Counter(
            str(e["tool_call_id"])
            for e in self.events()
            if e.get("kind") == "tool" and e.get("phase") == "start" and e.get("run_id") == session_id
        )

    def model_starts(self, session_id: str) -> list[dict[str, Any]]:
        """The run's model calls as they started (from the side-effect log)."""
        return [
            e
            for e in self.events()
            if e.get("kind") == "model" and e.get("phase") == "start" and e.get("run_id") == session_id
        ]

    def wait_event(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 20.0, what: str = "log event"
    ) -> dict[str, Any]:
        """The first logged event matching ``predicate``, waiting for it."""
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [e for e in self.events() if predicate(e)][:1]
            return bool(found)

        wait_until(seen, timeout, what)
        return found[0]

    def worker_logs(self) -> str:
        """Every worker log, concatenated."""
        return "".join(w.log_path.read_text(errors="replace") for w in self.workers)

    def step_times(self) -> list[float]:
        """Seconds each step (``lousho.advance`` task) took, from the workers' ``succeeded in`` lines."""
        return [float(t) for t in _STEP_TIME.findall(self.worker_logs())]

    def chained_steps(self) -> int:
        """Steps tasks took after an earlier step of the same task (continuation), from their logged results."""
        return sum(int(n) - 1 for n in _CHAINED.findall(self.worker_logs()))

    def sweeps(self) -> tuple[int, int]:
        """(recover sweeps the beats sent, sweeps the workers received). Far fewer received than sent
        means something else consumes the test's Redis db (or workers were down a long time)."""
        logs = [self.workdir / f"beat-{n}.log" for n in range(1, len(self.beats) + 1)]
        sent = sum(len(_SWEEP_SENT.findall(log.read_text(errors="replace"))) for log in logs if log.exists())
        return sent, len(_SWEEP_RECEIVED.findall(self.worker_logs()))

    def outcomes(self) -> Counter[str]:
        """How many steps ended with each ``Outcome`` (from the workers' ``advance ... -> x`` lines)."""
        return Counter(match.group(3) for match in _OUTCOME.finditer(self.worker_logs()))

    def explain(self, run_id: str, since: float, window_s: float = 8.0) -> str:
        """What happened to a run after ``since``: its logged work, saves and worker log lines."""
        lines = []
        for event in self.events():
            if event.get("run_id") == run_id and since - 1 <= event["ts"] <= since + window_s:
                what = event.get("tool_call_id", f"turn {event.get('turn_index')}")
                lines.append((event["ts"], f"{event['kind']} {event.get('phase', '')} {what} pid {event.get('pid')}"))
        with psycopg.connect(self.database_url) as conn:
            for seq, fence, saved in conn.execute(
                "SELECT seq, fence, extract(epoch FROM saved_at)::float8 FROM checkpoint_history"
                " WHERE session_id = %s ORDER BY seq",
                (run_id,),
            ):
                if since - 1 <= saved <= since + window_s:
                    lines.append((saved, f"save seq {seq} fence {fence}"))
        for match in _LOG_LINE.finditer(self.worker_logs()):
            # Log times are local time, as the ``logging`` module writes them.
            stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            text = match.group(3)
            if since - 1 <= stamp.timestamp() <= since + window_s and (
                run_id in text or "recover" in text or "exited" in text
            ):
                lines.append((stamp.timestamp(), f"{match.group(2)}: {text[:100]}"))
        return "\n".join(f"{ts - since:+7.2f} s  {text}" for ts, text in sorted(lines))

    @staticmethod
    def tail(path: Path, lines: int = 30) -> str:
        """The last lines of a log file."""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def save_state(self) -> None:
        """Copy the runs and their history into the work dir (the next test truncates the tables)."""
        with psycopg.connect(self.database_url) as conn:
            for table in ("runs", "checkpoint_history"):
                query = sql.SQL("SELECT row_to_json(t)::text FROM {} t").format(sql.Identifier(table))
                rows = conn.execute(query).fetchall()
                (self.workdir / f"{table}.jsonl").write_text("".join(row[0] + "\n" for row in rows))

    def dump_logs(self) -> None:
        """Print the end of every process log (on test failure)."""
        for worker in self.workers:
            print(f"--- {worker.log_path.name} (pid {worker.pid}) ---\n{self.tail(worker.log_path)}")
        for index in range(1, len(self.beats) + 1):
            print(f"--- beat-{index}.log ---\n{self.tail(self.workdir / f'beat-{index}.log', 10)}")

    def close(self) -> None:
        """Kill every process group started here (SIGKILL ends stopped ones too) and reap them."""
        processes = [w.process for w in self.workers] + self.beats
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_group_members(p.pid) for p in processes) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._client is not None:
            self._client.close()
        if self._redis is not None:
            self._redis.close()


def fresh_id(prefix: str) -> str:
    """A run id never used before: a run's events outlive a truncation of the run tables between tests."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _split_marker(name: str) -> tuple[str, str]:
    rest = name[len("crash-") :]
    for point in sorted(
        CRASH_POINTS + APPROVAL_CRASH_POINTS + ONCE_CRASH_POINTS + END_HOOK_CRASH_POINTS + CHAIN_CRASH_POINTS,
        key=len,
        reverse=True,
    ):
        if rest.startswith(point + "-"):
            return point, rest[len(point) + 1 :]
    raise ValueError(f"unknown crash marker {name!r}")


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``condition`` until true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
