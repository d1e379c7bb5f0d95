"""Taking one round of Lousho or of the bare chain: send the runs, wait for them, read back when each step ended.

It starts no worker, measures no CPU and prints nothing: ``bench.run`` decides what runs when, and
``bench.dbos_peer`` takes the DBOS peer's rounds the same way.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from bench import agents as bench_agents
from bench import payload
from bench.results import RoundResult, Span, chained_steps, gaps_ms, read_lines, steps_taken, task_times
from bench.watch import Consumers
from bench.workers import BenchError
from store import step_message

ADVANCE = step_message.ADVANCE


@dataclass(frozen=True)
class RoundSpec:
    """What one round of one system does: ``runs`` concurrent runs of ``length`` steps, ids starting ``prefix``."""

    system: str
    prefix: str
    number: int
    runs: int
    length: int
    result_bytes: int
    timings: Path
    timeout_s: float
    check: Callable[[], None]  # raises BenchError when a worker died

    def run_id(self, i: int) -> str:
        """The session (or chain, or workflow) id of the round's ``i``-th run."""
        return f"{self.prefix}{i:03d}"

    def result(
        self,
        started: float,
        ended: float,
        marks: dict[str, list[float]],
        created: dict[str, float],
        tasks: dict[str, list[Span]],
        taken: dict[str, list[int]] | None = None,
    ) -> RoundResult:
        """The round's figures: ``marks`` are the times of each run's steps, ``created`` when each run was sent.

        Step times are the deltas of consecutive marks of one run (the run's creation before the first);
        steps/s is the number of marks over ``ended - started``. ``taken`` (Lousho: the steps each timed task
        saved) gives the chained steps and finds a task's neighbour past the steps it chained.
        """
        short = [run_id for run_id, times in marks.items() if len(times) != self.length]
        if len(marks) != self.runs or short:
            raise BenchError(
                f"{self.system} runs {self.prefix}*: expected {self.runs} runs of {self.length} steps, "
                f"got {len(marks)} runs, {len(short)} with another count"
            )
        step_ms = []
        for run_id, times in marks.items():
            previous = created[run_id]
            for mark in times:
                step_ms.append((mark - previous) * 1000)
                previous = mark
        task_ms = [(end - start) * 1000 for spans in tasks.values() for start, end, _ in spans]
        wall = ended - started
        return RoundResult(
            self.system,
            self.number,
            len(step_ms),
            wall,
            len(step_ms) / wall,
            step_ms,
            task_ms,
            gaps_ms(tasks, taken),
            steps_per_run=self.length,
            chained_steps=chained_steps(taken) if taken is not None else None,
        )


def wait_for(spec: RoundSpec, progress: Callable[[], int], needed: int, what: str) -> None:
    """Poll ``progress`` every 50 ms until it reaches ``needed``; BenchError on timeout or a dead worker."""
    deadline = time.monotonic() + spec.timeout_s
    while True:
        done = progress()
        if done >= needed:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{spec.system} {what} {spec.prefix}*: {done}/{needed} in {spec.timeout_s} s")
        spec.check()
        time.sleep(0.05)


def lousho_round(
    spec: RoundSpec, db: psycopg.Connection[Any], handle: Any, consumers: Consumers | None = None
) -> RoundResult:
    """``runs`` concurrent Lousho runs sent through ``handle``; steps timed from ``checkpoint_history``.

    With ``consumers``, each run is marked watched before its send and followed after it; the result then
    carries what they saw and the CPU they used.
    """
    message = bench_agents.input_for(spec.length, spec.result_bytes)
    started = time.time()
    for i in range(spec.runs):
        if consumers is not None:
            consumers.watch(spec.run_id(i))
        handle.send(message, session_id=spec.run_id(i), check_agent=False)
        if consumers is not None:
            consumers.follow(spec.run_id(i))

    def finished() -> int:
        row = db.execute(
            "SELECT count(*) FILTER (WHERE status = 'finished'),"
            " count(*) FILTER (WHERE last_error IS NOT NULL AND NOT (last_error->>'retryable')::boolean)"
            " FROM runs WHERE session_id LIKE %s",
            (spec.prefix + "%",),
        ).fetchone()
        done, parked = (int(row[0]), int(row[1])) if row else (0, 0)
        if parked:
            raise BenchError(f"{parked} run(s) {spec.prefix}* of {spec.system} were parked with an error")
        return done

    wait_for(spec, finished, spec.runs, "runs finished")
    saves: dict[str, list[float]] = defaultdict(list)
    created: dict[str, float] = {}
    rows = db.execute(
        "SELECT r.session_id, extract(epoch FROM r.created_at)::float8, extract(epoch FROM h.saved_at)::float8"
        " FROM runs r JOIN checkpoint_history h USING (session_id)"
        " WHERE r.session_id LIKE %s ORDER BY r.session_id, h.seq",
        (spec.prefix + "%",),
    ).fetchall()
    for session_id, created_at, saved_at in rows:
        created[session_id] = float(created_at)
        saves[session_id].append(float(saved_at))
    ended = max((times[-1] for times in saves.values()), default=started)
    tasks = task_times(read_lines(spec.timings), ADVANCE, spec.prefix)
    result = spec.result(started, ended, saves, created, tasks, steps_taken(tasks, saves))
    if consumers is not None:
        followed = consumers.join()
        result.events_followed, result.live_followed = followed.events, followed.live
        result.consumer_cpu_s = followed.cpu_s
    return result


def bare_round(spec: RoundSpec, app: Any, queue: str) -> RoundResult:
    """``runs`` concurrent bare chains, each hop carrying ``result_bytes``; timed from the hops' start times."""
    from bench.bare import HOP

    carried = payload.result_text(spec.result_bytes, 0) if spec.result_bytes else ""
    sent: dict[str, float] = {}
    started = time.time()
    for i in range(spec.runs):
        sent[spec.run_id(i)] = time.time()
        app.send_task(HOP, args=(spec.run_id(i), 1, spec.length, carried), queue=queue)

    def hops_done() -> int:
        return sum(len(spans) for spans in task_times(read_lines(spec.timings), HOP, spec.prefix).values())

    wait_for(spec, hops_done, spec.runs * spec.length, "hops")
    tasks = task_times(read_lines(spec.timings), HOP, spec.prefix)
    starts = {chain: sorted(start for start, _, _ in spans) for chain, spans in tasks.items()}
    ended = max(end for spans in tasks.values() for _, end, _ in spans)
    return spec.result(started, ended, starts, sent, tasks)
