"""The DBOS peer's worker: the bench agent's run as a DBOS workflow, one checkpointed DBOS step per hop.

``python -m bench.dbos_app`` starts ``--processes`` serving processes (one DBOS executor each, one workflow
at a time, like one prefork process) and waits for SIGTERM; it sends no work and computes no figure.
Needs the optional ``dbos`` package; ``bench.dbos_peer`` is the bench side that enqueues and measures.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from bench import payload, timing

APP_NAME = "lousho-bench"
APP_VERSION = "bench"
QUEUE = "bench-dbos"
WORKFLOW = "bench_agent_run"
MODEL_STEP = "bench_model_turn"
TOOL_STEP = "bench_tool"
STEP_TIMING = "bench.dbos.step"


def _timed(run_id: str, hop: int, step: Callable[..., Any], *args: Any) -> Any:
    """Call one DBOS step (its body and DBOS's checkpoint of its output) and record the time it took."""
    start = time.time()
    output = step(*args)
    timing.record(STEP_TIMING, run_id, hop, start, time.time())
    return output


def define(dbos_module: Any) -> None:
    """Register the bench workflow and its two steps with DBOS (before ``DBOS.launch``)."""
    dbos = dbos_module.DBOS

    @dbos.step(name=MODEL_STEP)  # type: ignore[untyped-decorator]  # a module handed in as Any
    def model_turn(transcript: list[Any], turns: int, size: int) -> dict[str, Any]:
        """The scripted model: a call to the tool for the first ``turns`` turns, then a final text."""
        done = sum(1 for entry in transcript if entry[0] == "assistant")
        if done < turns:
            return {"tool_calls": [{"name": "noop", "args": {"size": size, "position": done}}]}
        return {"text": "done"}

    @dbos.step(name=TOOL_STEP)  # type: ignore[untyped-decorator]  # a module handed in as Any
    def tool(size: int, position: int) -> str:
        """The tool: ``size`` bytes of text, like ``bench.agents.noop``."""
        return payload.result_text(size, position)

    @dbos.workflow(name=WORKFLOW)  # type: ignore[untyped-decorator]  # a module handed in as Any
    def agent_run(turns: int, size: int) -> int:
        """Model turn, tool call, model turn, ..., final model turn: ``2 * turns + 1`` steps; returns the count."""
        run_id = dbos.workflow_id
        transcript: list[Any] = [("user", f"bench {turns} {size}")]
        hop = 0
        while True:
            hop += 1
            reply = _timed(run_id, hop, model_turn, transcript, turns, size)
            transcript.append(("assistant", reply))
            if "tool_calls" not in reply:
                return hop
            hop += 1
            args = reply["tool_calls"][0]["args"]
            transcript.append(("tool", _timed(run_id, hop, tool, args["size"], args["position"])))


def serve(database_url: str, index: int, polling_s: float, ready: Path, loglevel: str) -> int:
    """One serving process: launch DBOS as executor ``bench-<index>``, take workflows until SIGTERM."""
    import dbos as dbos_module

    define(dbos_module)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # The bench pauses these processes (SIGSTOP) outside their rounds: keep the server's idle-in-transaction
    # setting (normally off) rather than DBOS's 60 s, which could end a session paused inside a poll.
    config = dbos_module.DBOSConfig(
        name=APP_NAME,
        system_database_url=database_url,
        application_version=APP_VERSION,
        executor_id=f"bench-{index}",
        log_level=loglevel,
        sys_db_idle_transaction_timeout_sec=0,
    )
    dbos_module.DBOS(config=config)
    dbos_module.DBOS.launch()
    dbos_module.DBOS.register_queue(
        QUEUE, worker_concurrency=1, polling_interval_sec=polling_s, on_conflict="always_update"
    )
    ready.touch()
    stop.wait()
    dbos_module.DBOS.destroy()
    return 0


def _wait_for(path: Path, child: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if child.poll() is not None:
            raise SystemExit(f"DBOS serving process exited ({child.returncode}) before it was ready")
        if time.monotonic() > deadline:
            raise SystemExit(f"DBOS serving process not ready in {timeout_s} s")
        time.sleep(0.05)


def supervise(args: argparse.Namespace) -> int:
    """Start the serving processes (the first alone: it creates the system database), then wait for SIGTERM."""
    stop = threading.Event()

    def _stop(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    children: list[subprocess.Popen[bytes]] = []
    try:
        for index in range(args.processes):
            marker = Path(f"{args.ready}.{index}")
            command = [
                sys.executable,
                "-m",
                "bench.dbos_app",
                "--database-url",
                args.database_url,
                "--polling-s",
                str(args.polling_s),
                "--ready",
                str(marker),
                "--loglevel",
                args.loglevel,
                "--index",
                str(index),
            ]
            children.append(subprocess.Popen(command, env=os.environ.copy()))
            _wait_for(marker, children[-1])
        Path(args.ready).touch()
        while not stop.wait(0.5):
            if any(child.poll() is not None for child in children):
                return 1
        return 0
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.dbos_app``: supervise ``--processes`` serving processes, or be one (``--index``)."""
    parser = argparse.ArgumentParser(prog="python -m bench.dbos_app")
    parser.add_argument("--database-url", required=True, help="the DBOS system database")
    parser.add_argument("--processes", type=int, default=2, help="serving processes (one workflow at a time each)")
    parser.add_argument("--polling-s", type=float, default=0.05, help="queue polling interval of each process")
    parser.add_argument("--ready", required=True, help="file touched once every process is ready")
    parser.add_argument("--loglevel", default="WARNING")
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.index is not None:
        return serve(args.database_url, args.index, args.polling_s, Path(args.ready), args.loglevel)
    return supervise(args)


if __name__ == "__main__":
    sys.exit(main())
