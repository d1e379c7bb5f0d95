"""Consumers for ``--events watched``: one thread per run following its durable events, as a watching UI would.

A round marks each run watched before sending it (as ``AgentHandle.stream`` does), so its first step already
publishes notes, then follows it with ``Client.events`` from seq 0, live signals included (``live=True``, as
``lousho watch`` does), in a thread of this process until its ``run.done``. ``join`` checks what each consumer
saw (gapless from ``run.start`` to one ``run.done``) and sums the CPU time the consumer threads used. The
consumers have their own ``producer.Client`` and engine: their Postgres reads go to server processes of the
bench database, which ``bench.run`` counts as the round's.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bench.workers import BenchError

#: Seconds the consumers get, after their runs finished, to read their last events.
DRAIN_S = 10.0


@dataclass
class _Seen:
    """What one consumer saw of its run: durable events' seqs and types, live signals, CPU time, the error."""

    seqs: list[int] = field(default_factory=list)
    types: list[str] = field(default_factory=list)
    live: int = 0
    cpu_s: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class Followed:
    """The consumers of one round: durable events and live signals they saw, and the CPU their threads used."""

    events: int
    live: int
    cpu_s: float


class Consumers:
    """The consumers of one round of the watched Lousho worker."""

    def __init__(self, client: Any, timeout_s: float) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self._threads: dict[str, threading.Thread] = {}
        self._seen: dict[str, _Seen] = {}

    def watch(self, session_id: str) -> None:
        """Mark the run watched before it is sent, so its first step publishes too."""
        from producer import streams

        self._client.signals.watch(session_id, streams.WATCH_TTL_MS)

    def follow(self, session_id: str) -> None:
        """Start following the run (it must be stored: call after its send)."""
        seen = self._seen[session_id] = _Seen()
        thread = threading.Thread(
            target=self._consume, args=(session_id, seen), name=f"follow-{session_id}", daemon=True
        )
        self._threads[session_id] = thread
        thread.start()

    def _consume(self, session_id: str, seen: _Seen) -> None:
        started = time.thread_time()
        try:
            for event in self._client.events(session_id, after=-1, live=True, timeout=self._timeout_s):
                if event.seq is None:
                    seen.live += 1
                    continue
                seen.seqs.append(event.seq)
                seen.types.append(event.type)
        except Exception as exc:  # reported by join, with the run it ended
            seen.error = f"{type(exc).__name__}: {exc}"
        finally:
            seen.cpu_s = time.thread_time() - started

    def join(self) -> Followed:
        """Wait for every consumer (``DRAIN_S`` at most); BenchError when one failed or saw a broken sequence."""
        deadline = time.monotonic() + DRAIN_S
        for thread in self._threads.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        problems = []
        for session_id, thread in self._threads.items():
            seen = self._seen[session_id]
            if thread.is_alive():
                problems.append(f"{session_id}: still following after {DRAIN_S} s ({len(seen.seqs)} events)")
            elif seen.error is not None:
                problems.append(f"{session_id}: {seen.error}")
            elif (
                seen.seqs != list(range(len(seen.seqs)))
                or not seen.types
                or seen.types[0] != "run.start"
                or seen.types[-1] != "run.done"
                or seen.types.count("run.done") != 1
            ):
                problems.append(
                    f"{session_id}: saw {len(seen.seqs)} events, not seq 0.. from run.start to one "
                    f"run.done ({', '.join(seen.types[:3])} ... {', '.join(seen.types[-2:])})"
                )
        if problems:
            raise BenchError("consumers of the watched runs: " + "; ".join(problems[:5]))
        seen_all = self._seen.values()
        return Followed(
            sum(len(seen.seqs) for seen in seen_all),
            sum(seen.live for seen in seen_all),
            sum(seen.cpu_s for seen in seen_all),
        )
