"""Whether the worker's memory stays flat over many steps (``--rss-steps``): RSS read after each round of Lousho.

``soak`` takes rounds until enough steps are done and reads the worker processes' current resident set
(``VmRSS``, and ``RssAnon``, its private anonymous part) after each; ``flatness`` compares the reading at
about ``BASELINE_STEPS`` steps (the warm-up done) with the last one. ``bench.run`` starts the worker and
takes the rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.report import format_row
from bench.results import RoundResult
from bench.workers import Worker

BASELINE_STEPS = 1000
FLAT = 10.0  # issue 12: worker RSS flat within 10 % over 10,000 steps


@dataclass(frozen=True)
class Reading:
    """The worker processes' memory after ``steps`` steps, by role (``main``, ``child <pid>``), in KiB."""

    steps: int
    rss_kib: dict[str, int]
    anon_kib: dict[str, int]


def read(worker: Worker, steps: int) -> Reading:
    """The current ``VmRSS`` and ``RssAnon`` of the worker's main and pool processes."""
    return Reading(steps, worker.memory_kib("VmRSS"), worker.memory_kib("RssAnon"))


def soak(
    take_round: Callable[[int], RoundResult], worker: Worker, target: int
) -> tuple[list[RoundResult], list[Reading]]:
    """Rounds (``take_round(number)``) until ``target`` steps are done, the worker's memory read after each.

    Prints each round's row and its reading as it ends.
    """
    results: list[RoundResult] = []
    readings: list[Reading] = []
    done = 0
    while done < target:
        result = take_round(len(results) + 1)
        results.append(result)
        done += result.steps
        reading = read(worker, done)
        readings.append(reading)
        print(format_row(result.summary()) + "   rss " + _brief(reading), flush=True)
    return results, readings


def _brief(reading: Reading) -> str:
    return ", ".join(f"{role} {kib / 1024:.1f}" for role, kib in reading.rss_kib.items() if role != "main") + " MiB"


def baseline(readings: list[Reading]) -> Reading:
    """The reading nearest ``BASELINE_STEPS`` steps other than the last one (the only one when there is one)."""
    return min(readings[:-1] or readings, key=lambda r: abs(r.steps - BASELINE_STEPS))


def _change(before: int | None, after: int | None) -> float | None:
    if not before or after is None:
        return None
    return (after - before) * 100 / before


def flatness(readings: list[Reading]) -> dict[str, Any]:
    """Per process, ``VmRSS`` and ``RssAnon`` at the baseline and at the end, and the change in %.

    ``flat`` says whether every pool process present at both readings changed its ``VmRSS`` by at most
    ``FLAT`` %; None when no pool process was (they were all replaced, or none could be read).
    """
    first, last = baseline(readings), readings[-1]
    processes = {}
    for role in dict.fromkeys([*first.rss_kib, *last.rss_kib]):
        processes[role] = {
            "rss_kib_at_baseline": first.rss_kib.get(role),
            "rss_kib_at_end": last.rss_kib.get(role),
            "rss_change_pct": _change(first.rss_kib.get(role), last.rss_kib.get(role)),
            "anon_kib_at_baseline": first.anon_kib.get(role),
            "anon_kib_at_end": last.anon_kib.get(role),
            "anon_change_pct": _change(first.anon_kib.get(role), last.anon_kib.get(role)),
        }
    pool = [p["rss_change_pct"] for role, p in processes.items() if role != "main" and p["rss_change_pct"] is not None]
    return {
        "baseline_steps": first.steps,
        "end_steps": last.steps,
        "processes": processes,
        "largest_pool_change_pct": max(pool, key=abs) if pool else None,
        "flat": all(abs(x) <= FLAT for x in pool) if pool else None,
        "readings": [{"steps": r.steps, "rss_kib": r.rss_kib, "anon_kib": r.anon_kib} for r in readings],
    }


def _mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def print_flatness(figures: dict[str, Any], label: str) -> None:
    """The RSS table: per process, at the baseline and at the end, with the change; then whether it is flat."""
    first, end = figures["baseline_steps"], figures["end_steps"]
    print(f"\n{label} worker memory after warm-up: at {first:,} steps and at {end:,} steps (MiB)")
    print(
        f"| process | VmRSS at {first:,} | VmRSS at {end:,} | change | RssAnon at {first:,} "
        f"| RssAnon at {end:,} | change |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for role, p in figures["processes"].items():
        print(
            f"| {role} | {_mib(p['rss_kib_at_baseline'])} | {_mib(p['rss_kib_at_end'])} "
            f"| {_pct(p['rss_change_pct'])} | {_mib(p['anon_kib_at_baseline'])} | {_mib(p['anon_kib_at_end'])} "
            f"| {_pct(p['anon_change_pct'])} |"
        )
    if figures["flat"] is None:
        print("no pool process was read at both points (replaced?): no verdict")
        return
    verdict = "flat" if figures["flat"] else "NOT flat"
    print(
        f"pool processes' VmRSS: {verdict} within {FLAT:.0f}% (largest change "
        f"{_pct(figures['largest_pool_change_pct'])}; issue 12's target: flat within {FLAT:.0f}% over 10,000 steps)"
    )
