"""One round's figures: ``RoundResult``, percentiles, and the task spans read from the timing files.

Pure computation on numbers already collected; it starts nothing and talks to no service.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between closest ranks; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class RoundResult:
    """One round of one system."""

    system: str
    round: int
    steps: int
    wall_s: float
    steps_per_s: float
    step_ms: list[float] = field(repr=False)
    task_ms: list[float] = field(repr=False)
    gap_ms: list[float] = field(repr=False, default_factory=list)
    worker_cpu_s: float = 0.0
    worker_main_cpu_s: float = 0.0
    postgres_cpu_s: float = 0.0
    steps_per_run: int = 0
    # ``--events`` only: durable events the round's runs stored, and what the consumers of watched runs saw
    # (durable events, live signals) and the CPU their threads used.
    events_stored: int | None = None
    events_followed: int | None = None
    live_followed: int | None = None
    consumer_cpu_s: float | None = None
    #: Lousho only: steps saved during a timed task that had already saved one (more than one step per task
    #: means the task took its run's next steps itself: ``--continue``).
    chained_steps: int | None = None

    def summary(self) -> dict[str, Any]:
        """The round's figures as JSON-ready numbers (ms, rounded), as printed and written."""
        return self._figures() | self._chain_figures() | self._event_figures()

    def _figures(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "round": self.round,
            "steps_per_run": self.steps_per_run,
            "steps": self.steps,
            "wall_s": round(self.wall_s, 4),
            "steps_per_s": round(self.steps_per_s, 2),
            "step_p50_ms": round(percentile(self.step_ms, 50), 3),
            "step_p99_ms": round(percentile(self.step_ms, 99), 3),
            "task_p50_ms": round(percentile(self.task_ms, 50), 3),
            "task_p99_ms": round(percentile(self.task_ms, 99), 3),
            "tasks_timed": len(self.task_ms),
            "gap_p50_ms": round(percentile(self.gap_ms, 50), 3),
            "worker_cpu_ms_per_step": round(self.worker_cpu_s * 1000 / self.steps, 3),
            "worker_main_cpu_ms_per_step": round(self.worker_main_cpu_s * 1000 / self.steps, 3),
            "postgres_cpu_ms_per_step": round(self.postgres_cpu_s * 1000 / self.steps, 3),
        }

    def _chain_figures(self) -> dict[str, Any]:
        if self.chained_steps is None:
            return {}
        return {"chained_steps": self.chained_steps, "chained_share": round(self.chained_steps / self.steps, 4)}

    def _event_figures(self) -> dict[str, Any]:
        runs = max(self.steps // max(self.steps_per_run, 1), 1)
        found: dict[str, Any] = {}
        if self.events_stored is not None:
            found["events_stored_per_run"] = round(self.events_stored / runs, 2)
        if self.events_followed is not None and self.live_followed is not None:
            found["events_followed_per_run"] = round(self.events_followed / runs, 2)
            found["live_followed_per_run"] = round(self.live_followed / runs, 2)
        if self.consumer_cpu_s is not None:
            found["consumer_cpu_ms_per_step"] = round(self.consumer_cpu_s * 1000 / self.steps, 3)
        return found


Span = tuple[float, float, int | None]  # start, end, position in the run (seq or hop number)


def task_times(lines: Iterator[list[str]], name: str, prefix: str) -> dict[str, list[Span]]:
    """(start, end, position) of each timed task of ``name`` whose first argument starts with ``prefix``."""
    found: dict[str, list[Span]] = defaultdict(list)
    for parts in lines:
        if len(parts) == 5 and parts[0] == name and parts[1].startswith(prefix):
            position = int(parts[2]) if parts[2].isdigit() else None
            found[parts[1]].append((float(parts[3]), float(parts[4]), position))
    return found


def steps_taken(tasks: dict[str, list[Span]], saves: dict[str, list[float]]) -> dict[str, list[int]]:
    """Per run, how many of its steps were saved during each of its timed tasks, in ``tasks``' order.

    One per task in strict mode; a task that took its run's next steps itself (``--continue``) saved several.
    ``saves`` are each run's save times, on the same clock as the spans (one host). A save counts for the
    latest-starting task whose span holds it: a task publishes its run's next step before its span ends, so the
    next task (in another pool process) may save before it does; and a duplicate delivery dropped as busy inside
    a task's span, ended before that task saved, takes nothing from it. A save no span holds counts for none.
    """
    taken: dict[str, list[int]] = {}
    for run_id, spans in tasks.items():
        by_start = sorted(range(len(spans)), key=lambda i: spans[i][0])
        starts = [spans[i][0] for i in by_start]
        counts = [0] * len(spans)
        for saved in saves.get(run_id, []):
            for k in range(bisect_right(starts, saved) - 1, -1, -1):
                if spans[by_start[k]][1] >= saved:
                    counts[by_start[k]] += 1
                    break
        taken[run_id] = counts
    return taken


def chained_steps(taken: dict[str, list[int]]) -> int:
    """Steps that ran in the same task as the step before them: every step of a task but its first."""
    return sum(count - 1 for counts in taken.values() for count in counts if count > 1)


def gaps_ms(tasks: dict[str, list[Span]], taken: dict[str, list[int]] | None = None) -> list[float]:
    """Time from the end of one task to the start of the next task of the same run (delivery and ack).

    ``taken`` (from ``steps_taken``) tells how many steps each task took, so the next task of a run that
    chained is found past them; without it every task took one. A task that took none (a duplicate delivery
    dropped as busy) is passed over.
    """
    gaps = []
    for run_id, spans in tasks.items():
        counts = taken.get(run_id, []) if taken is not None else []
        ordered = sorted(item for item in zip(spans, counts or [1] * len(spans), strict=True) if item[1])
        for ((_, end, position), count), ((start, _, following), _) in pairwise(ordered):
            # Only neighbours: a pool process's first task is not timed (the hook loads with the agents).
            if position is not None and following == position + count:
                gaps.append((start - end) * 1000)
    return gaps


def read_lines(path: Path) -> Iterator[list[str]]:
    """The tab-separated fields of each complete line of a timing file (nothing when it does not exist yet).

    A worker may be writing a line while it is read: the text after the last newline is left for the next read.
    """
    if not path.exists():
        return iter(())
    text = path.read_text()
    return (line.split("\t") for line in text[: text.rfind("\n") + 1].splitlines())
