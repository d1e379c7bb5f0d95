"""A consumer of a run's durable events in a process of its own, for the crash tests to kill and restart.

``python -m tests.support.event_consumer AGENT SESSION OUT [--after SEQ] [--timeout S]`` follows the run with
``Client().agent(AGENT).events(SESSION, after=SEQ)`` (no ``--after``: from the run's latest ``run.start``) and
appends each event to OUT as one JSON line: ``seq``, ``type``, ``at``, ``data``, plus ``seen`` (when this
process got it, epoch seconds) and ``pid``. Each line is one ``os.write`` on an ``O_APPEND`` descriptor, so it
is on disk before the next event is read and a SIGKILL never leaves half a line behind. The services come
from the ``LOUSHO_*`` environment, as for a worker. It prints ``following`` once it reads the run, and exits 0
after the ``run.done``, 3 on a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from producer.client import Client
from store import errors

#: Exit code when the run did not finish within ``--timeout``.
TIMED_OUT = 3
#: What the consumer prints once it follows the run (imports done, connected).
READY = "following"


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The events a consumer wrote to ``path`` so far, in the order it wrote them."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def consume(agent: str, session_id: str, out: Path, after: int | None, timeout: float) -> int:
    """Write the run's events after ``after`` to ``out`` until its ``run.done``; the process's exit code."""
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        with Client() as client:
            following = client.agent(agent).events(session_id, after=after, timeout=timeout)
            print(f"{READY} {session_id} after {after}", flush=True)
            try:
                for event in following:
                    wire = event.wire()
                    line = {
                        "seq": wire["seq"],
                        "type": wire["type"],
                        "at": wire["at"],
                        "data": wire["data"],
                        "seen": time.time(),
                        "pid": os.getpid(),
                    }
                    os.write(fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())
            except errors.RunTimeoutError as exc:
                print(f"event consumer: {exc}", file=sys.stderr)
                return TIMED_OUT
    finally:
        os.close(fd)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("agent")
    parser.add_argument("session_id")
    parser.add_argument("out", type=Path)
    parser.add_argument("--after", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    return consume(args.agent, args.session_id, args.out, args.after, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
