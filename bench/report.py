"""The benchmark's output: the table rows, the summary over rounds with its ratios, and the JSON file.

It formats and aggregates ``RoundResult``s; it measures nothing itself.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.config import Config
from bench.results import RoundResult, percentile

RESULTS = Path(__file__).resolve().parent / "results"

HEADER = (f"{'round':>5}  {'system':<7} {'steps':>6} {'wall s':>7} {'steps/s':>8} "
          f"{'step p50':>9} {'step p99':>9} {'task p50':>9} {'task p99':>9} {'gap p50':>8} "
          f"{'wrk cpu':>8} {'pg cpu':>7}")


def format_row(s: dict[str, Any]) -> str:
    """One line of the table for a round's (or a system's overall) summary, under ``HEADER``."""
    return (f"{s['round']!s:>5}  {s['system']:<7} {s['steps']:>6} {s['wall_s']:>7.3f} {s['steps_per_s']:>8.1f} "
            f"{s['step_p50_ms']:>9.2f} {s['step_p99_ms']:>9.2f} {s['task_p50_ms']:>9.2f} {s['task_p99_ms']:>9.2f} "
            f"{s['gap_p50_ms']:>8.2f} {s['worker_cpu_ms_per_step']:>8.2f} {s['postgres_cpu_ms_per_step']:>7.2f}")


def aggregate(results: list[RoundResult]) -> dict[str, Any]:
    """Per system: median steps/s over rounds, percentiles over every step of every round; the ratios."""
    summary: dict[str, Any] = {}
    systems = list(dict.fromkeys(r.system for r in results))
    for system in systems:
        mine = [r for r in results if r.system == system]
        rates = [r.steps_per_s for r in mine]
        steps = [x for r in mine for x in r.step_ms]
        tasks = [x for r in mine for x in r.task_ms]
        gaps = [x for r in mine for x in r.gap_ms]
        count = sum(r.steps for r in mine)
        summary[system] = {
            "system": system, "round": "all", "steps": count, "wall_s": round(sum(r.wall_s for r in mine), 4),
            "steps_per_s": round(statistics.median(rates), 2),
            "steps_per_s_min": round(min(rates), 2), "steps_per_s_max": round(max(rates), 2),
            "step_p50_ms": round(percentile(steps, 50), 3), "step_p99_ms": round(percentile(steps, 99), 3),
            "task_p50_ms": round(percentile(tasks, 50), 3), "task_p99_ms": round(percentile(tasks, 99), 3),
            "gap_p50_ms": round(percentile(gaps, 50), 3),
            "worker_cpu_ms_per_step": round(sum(r.worker_cpu_s for r in mine) * 1000 / count, 3),
            "worker_main_cpu_ms_per_step": round(sum(r.worker_main_cpu_s for r in mine) * 1000 / count, 3),
            "postgres_cpu_ms_per_step": round(sum(r.postgres_cpu_s for r in mine) * 1000 / count, 3),
        }
        summary[system]["cpu_ms_per_step"] = round(
            summary[system]["worker_cpu_ms_per_step"] + summary[system]["postgres_cpu_ms_per_step"], 3)
    rounds: dict[int, dict[str, float]] = defaultdict(dict)
    for r in results:
        rounds[r.round][r.system] = r.steps_per_s
    summary["ratios"] = {}
    for system, base in [(s, "bare") for s in systems if s != "bare"] + [("other", "lousho")]:
        if system not in summary or base not in summary:
            continue
        paired = [p[system] / p[base] for p in rounds.values() if system in p and base in p]
        summary["ratios"][f"{system}/{base}"] = {
            "steps_per_s": round(summary[system]["steps_per_s"] / summary[base]["steps_per_s"], 3),
            "paired_median": round(statistics.median(paired), 3),
            "per_round": [round(x, 3) for x in paired],
            "cpu": round(summary[base]["cpu_ms_per_step"] / summary[system]["cpu_ms_per_step"], 3),
            "added_wall_ms_per_step": round(
                1000 / summary[system]["steps_per_s"] - 1000 / summary[base]["steps_per_s"], 3),
        }
    summary["ratio"] = summary["ratios"]["lousho/bare"]["steps_per_s"]
    return summary


def report(config: Config, summary: dict[str, Any], rss: dict[str, dict[str, int]]) -> None:
    """Print the summary table, the ratios, CPU per step, the load average and the peak RSS."""
    systems = [name for name in ("lousho", "other", "bare") if name in summary]
    print()
    print(f"summary: {config.runs} concurrent runs x {config.steps_per_run} steps, {config.rounds} round(s) each, "
          f"prefork -c {config.concurrency}, agent {config.agent}"
          + (f", other = {config.other_tree}" if config.other_tree else ""))
    print("  steps/s: median of rounds (range); percentiles over every step of every round (ms); cpu: ms per step")
    print(HEADER)
    for system in systems:
        print(format_row(summary[system]))
    print("  steps/s range over rounds: " + ", ".join(
        f"{s} {summary[s]['steps_per_s_min']:.1f}-{summary[s]['steps_per_s_max']:.1f}" for s in systems))
    for name, ratio in summary["ratios"].items():
        per_round = ", ".join(f"{x:.2f}" for x in ratio["per_round"])
        target = ""
        if name.endswith("/bare"):
            target = " (meets the 0.75x target)" if ratio["steps_per_s"] >= 0.75 else " (below the 0.75x target)"
        print(f"ratio {name} steps/s: {ratio['steps_per_s']:.3f}x{target}; paired by round: median "
              f"{ratio['paired_median']:.3f}x ({per_round}); CPU per step: {ratio['cpu']:.3f}x; "
              f"added wall time per step: {ratio['added_wall_ms_per_step']:.2f} ms")
    print("CPU per step, worker (of which its main process) + bench database backends; Redis not counted: " + ", ".join(
        f"{s} {summary[s]['worker_cpu_ms_per_step']:.2f} ({summary[s]['worker_main_cpu_ms_per_step']:.2f}) + "
        f"{summary[s]['postgres_cpu_ms_per_step']:.2f} ms" for s in systems))
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    for label, peaks in rss.items():
        if peaks:
            parts = ", ".join(f"{role} {kib / 1024:.1f}" for role, kib in peaks.items())
            print(f"peak RSS (VmHWM, MiB) {label} worker: {parts}")


def write_json(config: Config, results: list[RoundResult], summary: dict[str, Any],
               rss: dict[str, dict[str, int]]) -> Path:
    """Write the configuration, every round, the summary and the peak RSS as JSON; return its path."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = Path(config.json_path) if config.json_path else RESULTS / f"bench-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "when": stamp, "config": asdict(config) | {"steps_per_run": config.steps_per_run},
        "rounds": [r.summary() for r in results], "summary": summary, "peak_rss_kib": rss,
        "host": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path
