"""``lousho demo``: a run survives a killed worker, shown as a timeline.

Starts a worker and beat on the configured services, sends the example shop agent an order,
SIGKILLs the worker's whole process group in the middle of its tool batch, starts a new worker
and shows the run finishing without repeating the tool call whose result was already saved.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from producer.client import Client
from store import redaction
from store.database import ensure_database, migrate
from store.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
#: Fast recovery for the demo: 2 s lease, 0.5 s heartbeat, 1 s sweep.
DEMO_TIMING = {"LOUSHO_LEASE_TTL_MS": "2000", "LOUSHO_LEASE_RENEW_MS": "500", "LOUSHO_RECOVER_INTERVAL_S": "1"}


class _Timeline:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def say(self, text: str) -> None:
        print(f"  {time.monotonic() - self.start:6.2f}s  {text}", flush=True)


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    handle = log.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "worker", *args],
        cwd=ROOT,
        env=env,
        stdout=handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(process: subprocess.Popen[bytes], *, kill: bool = False) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
        process.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=5)


def _effects(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo: timed out waiting for {what}")
        time.sleep(0.05)


def run_demo(settings: Settings) -> int:
    """Run the demo; returns the exit status."""
    redaction.install()
    ensure_database(settings)
    migrate(settings)
    workdir = Path(tempfile.mkdtemp(prefix="lousho-demo-"))
    effects = workdir / "effects.jsonl"
    env = {
        **os.environ,
        **DEMO_TIMING,
        "LOUSHO_AGENTS": "examples.shop",
        "LOUSHO_DEMO_LOG": str(effects),
        "LOUSHO_DEMO_CHARGE_S": "2.5",
        "LOUSHO_DATABASE_URL": settings.database_url,
        "LOUSHO_REDIS_URL": settings.redis_url,
        "PYTHONPATH": str(ROOT),
    }
    worker_args = [
        "worker",
        "-P",
        "prefork",
        "-c",
        "2",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "--loglevel",
        "WARNING",
    ]
    timeline = _Timeline()
    print(f"database {settings.database_url.split('@')[-1]}   redis {settings.redis_url.split('@')[-1]}")
    print(f"worker and beat logs in {workdir}")
    beat = _spawn(["beat", "-s", str(workdir / "beat-schedule"), "--loglevel", "WARNING"], env, workdir / "beat.log")
    first = _spawn(worker_args, env, workdir / "worker-1.log")
    second: subprocess.Popen[bytes] | None = None
    try:
        timeline.say(f"started worker 1 (pid {first.pid}) and beat (pid {beat.pid})")
        session_id = f"demo-order-{int(time.time())}"
        with Client(settings) as client:
            run = client.agent("shop").send(
                "Reserve two teas, charge 5 and ship order 7", session_id=session_id, check_agent=False
            )
            timeline.say(f"sent run {session_id}")

            def reserved_and_charging() -> bool:
                events = {(e["tool"], e["event"]) for e in _effects(effects)}
                return ("reserve_stock", "end") in events and ("charge", "start") in events

            _wait_for(reserved_and_charging, 60, "the tool batch")
            time.sleep(0.3)  # let reserve_stock's result be saved while charge is still running
            timeline.say("reserve_stock finished and was saved; charge is running")
            _stop(first, kill=True)
            timeline.say(f"SIGKILL worker 1's whole process group (pid {first.pid}) mid-batch")
            second = _spawn(worker_args, env, workdir / "worker-2.log")
            timeline.say(f"started worker 2 (pid {second.pid}); it waits for the dead worker's lease to expire")
            killed_at = time.monotonic()
            result = run.wait(timeout=60)
            timeline.say(
                f"run finished: {result.finish_reason!r} after {result.steps} model turns, "
                f"{time.monotonic() - killed_at:.1f}s after the kill"
            )
        print(f"\n  final answer: {result.text}\n\n  tool executions (from the tools' own log):")
        runs: dict[str, list[str]] = {}
        for event in _effects(effects):
            if event["session_id"] == session_id and event["event"] == "start":
                runs.setdefault(f"{event['tool']} ({event['tool_call_id']})", []).append(str(event["pid"]))
        for call, pids in runs.items():
            note = "" if len(pids) == 1 else "   <- was in flight when killed: run again, same idempotency key"
            print(f"    {call:32} ran {len(pids)}x (pids {', '.join(pids)}){note}")
        repeated = [call for call, pids in runs.items() if len(pids) > 1 and not call.startswith("charge")]
        print("\n  completed tools repeated: " + (", ".join(repeated) if repeated else "none"))
        return 1 if repeated else 0
    finally:
        for process in (second, first, beat):
            if process is not None:
                _stop(process)
        timeline.say("stopped worker and beat")
