"""One round's figures: ``RoundResult``, percentiles, and the task spans read from the timing files.

Pure computation on numbers already collected; it starts nothing and talks to no service.
"""

from __future__ import annotations

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

    def summary(self) -> dict[str, Any]:
        """The round's figures as JSON-ready numbers (ms, rounded), as printed and written."""
        return {
            "system": self.system, "round": self.round, "steps_per_run": self.steps_per_run, "steps": self.steps,
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


Span = tuple[float, float, int | None]  # start, end, position in the run (seq or hop number)


def task_times(lines: Iterator[list[str]], name: str, prefix: str) -> dict[str, list[Span]]:
    """(start, end, position) of each timed task of ``name`` whose first argument starts with ``prefix``."""
    found: dict[str, list[Span]] = defaultdict(list)
    for parts in lines:
        if len(parts) == 5 and parts[0] == name and parts[1].startswith(prefix):
            position = int(parts[2]) if parts[2].isdigit() else None
            found[parts[1]].append((float(parts[3]), float(parts[4]), position))
    return found


def gaps_ms(tasks: dict[str, list[Span]]) -> list[float]:
    """Time from the end of one task to the start of the next task of the same run (delivery and ack)."""
    gaps = []
    for spans in tasks.values():
        ordered = sorted(spans)
        for (_, end, position), (start, _, following) in pairwise(ordered):
            # Only neighbours: a pool process's first task is not timed (the hook loads with the agents).
            if position is not None and following == position + 1:
                gaps.append((start - end) * 1000)
    return gaps


def read_lines(path: Path) -> Iterator[list[str]]:
    """The tab-separated fields of each line of a timing file (nothing when it does not exist yet)."""
    if not path.exists():
        return iter(())
    return (line.split("\t") for line in path.read_text().splitlines())
