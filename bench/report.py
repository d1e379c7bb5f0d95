"""The benchmark's output: the table rows, the summary per run length with its ratios, the per-system tables, the JSON.

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

from bench.config import CHAIN, Config
from bench.results import RoundResult, percentile

RESULTS = Path(__file__).resolve().parent / "results"

#: Pairs whose difference is what events cost (``--events``): saves writing events against saves writing
#: none, and runs a consumer follows against runs nobody follows.
EVENT_PAIRS = (("lousho", "ev-off"), ("watched", "lousho"))
#: The events' target: with them, at least this fraction of the steps/s without them (within 10%).
EVENTS_TARGET = 0.9
EVENT_LEGEND = {
    "on": "lousho writes events (LOUSHO_EVENTS=1, the default)",
    "off": "ev-off writes none (LOUSHO_EVENTS=0)",
    "watched": "watched writes them and a consumer follows every run (client.events, live=True)",
}

HEADER = (
    f"{'len':>4} {'round':>5}  {'system':<12} {'steps':>6} {'wall s':>7} {'steps/s':>8} "
    f"{'step p50':>9} {'step p99':>9} {'task p50':>9} {'task p99':>9} {'gap p50':>8} "
    f"{'wrk cpu':>8} {'pg cpu':>7}"
)


def format_row(s: dict[str, Any]) -> str:
    """One line of the table for a round's (or a system's overall) summary, under ``HEADER``."""
    return (
        f"{s['steps_per_run']:>4} {s['round']!s:>5}  {s['system']:<12} {s['steps']:>6} {s['wall_s']:>7.3f} "
        f"{s['steps_per_s']:>8.1f} "
        f"{s['step_p50_ms']:>9.2f} {s['step_p99_ms']:>9.2f} {s['task_p50_ms']:>9.2f} {s['task_p99_ms']:>9.2f} "
        f"{s['gap_p50_ms']:>8.2f} {s['worker_cpu_ms_per_step']:>8.2f} {s['postgres_cpu_ms_per_step']:>7.2f}"
    )


def _overall(system: str, length: int, mine: list[RoundResult], peak_rss_kib: int) -> dict[str, Any]:
    """One system's figures at one run length over every round: median steps/s, percentiles over all steps."""
    rates = [r.steps_per_s for r in mine]
    steps = [x for r in mine for x in r.step_ms]
    tasks = [x for r in mine for x in r.task_ms]
    gaps = [x for r in mine for x in r.gap_ms]
    count = sum(r.steps for r in mine)
    row: dict[str, Any] = {
        "system": system,
        "round": "all",
        "steps_per_run": length,
        "steps": count,
        "wall_s": round(sum(r.wall_s for r in mine), 4),
        "steps_per_s": round(statistics.median(rates), 2),
        "steps_per_s_min": round(min(rates), 2),
        "steps_per_s_max": round(max(rates), 2),
        "step_p50_ms": round(percentile(steps, 50), 3),
        "step_p99_ms": round(percentile(steps, 99), 3),
        "task_p50_ms": round(percentile(tasks, 50), 3),
        "task_p99_ms": round(percentile(tasks, 99), 3),
        "gap_p50_ms": round(percentile(gaps, 50), 3),
        "worker_cpu_ms_per_step": round(sum(r.worker_cpu_s for r in mine) * 1000 / count, 3),
        "worker_main_cpu_ms_per_step": round(sum(r.worker_main_cpu_s for r in mine) * 1000 / count, 3),
        "postgres_cpu_ms_per_step": round(sum(r.postgres_cpu_s for r in mine) * 1000 / count, 3),
        "peak_rss_mib": round(peak_rss_kib / 1024, 1),
    }
    row["cpu_ms_per_step"] = round(row["worker_cpu_ms_per_step"] + row["postgres_cpu_ms_per_step"], 3)
    chained = [r.chained_steps for r in mine if r.chained_steps is not None]
    if chained:  # a Lousho worker: how many steps its tasks took (more than one with ``--continue on``)
        row["chained_share"] = round(sum(chained) / count, 4)
        row["steps_per_task"] = round(count / len(tasks), 2) if tasks else None
    runs = sum(r.steps // max(r.steps_per_run, 1) for r in mine) or 1
    stored = [r.events_stored for r in mine if r.events_stored is not None]
    if stored:
        row["events_stored_per_run"] = round(sum(stored) / runs, 2)
    followed = [
        (r.events_followed or 0, r.live_followed or 0, r.consumer_cpu_s or 0.0)
        for r in mine
        if r.consumer_cpu_s is not None
    ]
    if followed:
        row["events_followed_per_run"] = round(sum(f[0] for f in followed) / runs, 2)
        row["live_followed_per_run"] = round(sum(f[1] for f in followed) / runs, 2)
        row["consumer_cpu_ms_per_step"] = round(sum(f[2] for f in followed) * 1000 / count, 3)
    return row


def _ratios(rows: dict[str, dict[str, Any]], results: list[RoundResult]) -> dict[str, Any]:
    """Steps/s (overall and paired by round), CPU and added wall time of each system against its baseline."""
    rounds: dict[int, dict[str, float]] = defaultdict(dict)
    for r in results:
        rounds[r.round][r.system] = r.steps_per_s
    pairs = [(s, "bare") for s in rows if s != "bare"] + [
        ("other", "lousho"),
        ("lousho", "dbos"),
        ("lousho", "floor"),
        (CHAIN, "dbos"),
        (CHAIN, "lousho"),
    ]
    ratios = {}
    for system, base in pairs:
        if system not in rows or base not in rows:
            continue
        paired = [p[system] / p[base] for p in rounds.values() if system in p and base in p]
        ratios[f"{system}/{base}"] = {
            "steps_per_s": round(rows[system]["steps_per_s"] / rows[base]["steps_per_s"], 3),
            "paired_median": round(statistics.median(paired), 3),
            "per_round": [round(x, 3) for x in paired],
            "cpu": round(rows[base]["cpu_ms_per_step"] / rows[system]["cpu_ms_per_step"], 3),
            "added_wall_ms_per_step": round(1000 / rows[system]["steps_per_s"] - 1000 / rows[base]["steps_per_s"], 3),
        }
    return ratios


def _event_costs(rows: dict[str, dict[str, Any]], results: list[RoundResult]) -> dict[str, Any]:
    """What events cost at one run length (``--events``): events on against off, watched runs against unwatched.

    Per pair, from the rounds where both ran: the paired median of the steps/s ratio, each system's paired
    median ratio to bare, the second's worker plus Postgres CPU per step over the first's (``cpu``, as in
    ``_ratios``), and the wall time and the worker and Postgres CPU per step the first adds over the second
    (over every round, and the paired median of the rounds' differences). Empty without ``--events``.
    """
    by_round: dict[int, dict[str, RoundResult]] = defaultdict(dict)
    for r in results:
        by_round[r.round][r.system] = r
    costs: dict[str, Any] = {}
    for system, base in EVENT_PAIRS:
        if system not in rows or base not in rows:
            continue
        pairs = [(p[system], p[base]) for p in by_round.values() if system in p and base in p]
        ratios = [a.steps_per_s / b.steps_per_s for a, b in pairs]
        entry: dict[str, Any] = {
            "steps_per_s_paired_median": round(statistics.median(ratios), 3),
            "per_round": [round(x, 3) for x in ratios],
        }
        if (system, base) == EVENT_PAIRS[0]:
            entry["within_target"] = statistics.median(ratios) >= EVENTS_TARGET
        wall = 1000 / rows[system]["steps_per_s"] - 1000 / rows[base]["steps_per_s"]
        entry["added_wall_ms_per_step"] = round(wall, 3)
        entry["cpu"] = round(rows[base]["cpu_ms_per_step"] / rows[system]["cpu_ms_per_step"], 3)
        for name in (system, base):
            if "bare" in rows and name != "bare":
                paired = [
                    p[name].steps_per_s / p["bare"].steps_per_s for p in by_round.values() if name in p and "bare" in p
                ]
                entry[f"{name}_over_bare_paired_median"] = round(statistics.median(paired), 3)
        for cpu in ("worker", "postgres"):
            added = [
                (getattr(a, f"{cpu}_cpu_s") / a.steps - getattr(b, f"{cpu}_cpu_s") / b.steps) * 1000 for a, b in pairs
            ]
            key = f"{cpu}_cpu_ms_per_step"
            entry[f"added_{key}"] = round(rows[system][key] - rows[base][key], 3)
            entry[f"added_{key}_paired_median"] = round(statistics.median(added), 3)
            entry[f"added_{key}_per_round"] = [round(x, 3) for x in added]
        costs[f"{system}/{base}"] = entry
    return costs


def _sweep(lengths: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per system, how its ratio to bare and its task p99 change from 21 steps (or the shortest) to the longest."""
    ordered = sorted(lengths)
    short = 21 if 21 in lengths else ordered[0]
    long = ordered[-1]
    sweep: dict[str, Any] = {}
    for system in lengths[long]["systems"]:
        if system not in lengths[short]["systems"]:
            continue
        at_short, at_long = lengths[short]["systems"][system], lengths[long]["systems"][system]
        entry = {
            "shortest": short,
            "longest": long,
            "task_p99_longest_over_shortest": round(at_long["task_p99_ms"] / at_short["task_p99_ms"], 3),
        }
        key = f"{system}/bare"
        if key in lengths[short]["ratios"] and key in lengths[long]["ratios"]:
            entry["ratio_longest_over_shortest"] = round(
                lengths[long]["ratios"][key]["steps_per_s"] / lengths[short]["ratios"][key]["steps_per_s"], 3
            )
        sweep[system] = entry
    return sweep


def _continuation(rows: dict[str, dict[str, Any]], slice_ms: int) -> dict[str, Any]:
    """What chaining did at one run length (``--continue``): steps per task, and the step p99 against the target.

    A run waiting behind a chained task waits up to one slice longer than behind a single step, so the target is
    lousho-chain's step p99 above lousho's by at most the slice.
    """
    chain, strict = rows[CHAIN], rows["lousho"]
    added = chain["step_p99_ms"] - strict["step_p99_ms"]
    return {
        "chained_share": chain.get("chained_share"),
        "steps_per_task": chain.get("steps_per_task"),
        "slice_ms": slice_ms,
        "step_p99_added_ms": round(added, 3),
        "step_p99_within_slice": added <= slice_ms,
    }


def aggregate(
    results: list[RoundResult], peak_rss: dict[int, dict[str, int]], slice_ms: int | None = None
) -> dict[str, Any]:
    """Per run length and system the overall figures and the ratios; per system how they change with the length.

    ``peak_rss`` maps a run length to each system's largest VmHWM (KiB) read after that length's rounds;
    ``slice_ms`` is lousho-chain's ``LOUSHO_CONTINUE_MS`` (``--continue``), for its step p99 target.
    """
    lengths: dict[int, dict[str, Any]] = {}
    for length in sorted({r.steps_per_run for r in results}):
        at_length = [r for r in results if r.steps_per_run == length]
        rows = {
            system: _overall(
                system, length, [r for r in at_length if r.system == system], peak_rss.get(length, {}).get(system, 0)
            )
            for system in dict.fromkeys(r.system for r in at_length)
        }
        if "bare" in rows:  # what a system's step costs on top of bare Celery's hop
            for row in rows.values():
                row["added_cpu_ms_per_step_over_bare"] = round(
                    row["cpu_ms_per_step"] - rows["bare"]["worker_cpu_ms_per_step"], 3
                )
        lengths[length] = {"systems": rows, "ratios": _ratios(rows, at_length)}
        costs = _event_costs(rows, at_length)
        if costs:
            lengths[length]["events"] = costs
        if slice_ms is not None and CHAIN in rows and "lousho" in rows:
            lengths[length]["continuation"] = _continuation(rows, slice_ms)
    return {"lengths": lengths, "sweep": _sweep(lengths)}


def _print_ratios(length: int, ratios: dict[str, Any]) -> None:
    for name, ratio in ratios.items():
        per_round = ", ".join(f"{x:.2f}" for x in ratio["per_round"])
        target = ""
        if name == "lousho/bare":
            target = " (meets the 0.75x target)" if ratio["steps_per_s"] >= 0.75 else " (below the 0.75x target)"
        print(
            f"  {length:>4} steps, {name} steps/s: {ratio['steps_per_s']:.3f}x{target}; paired by round: median "
            f"{ratio['paired_median']:.3f}x ({per_round}); CPU per step: {ratio['cpu']:.3f}x; "
            f"added wall time per step: {ratio['added_wall_ms_per_step']:.2f} ms"
        )


def _print_step_costs(length: int, rows: dict[str, dict[str, Any]]) -> None:
    """Each system's worker plus Postgres CPU per step, side by side."""
    cpu = ", ".join(f"{system} {row['cpu_ms_per_step']:.2f}" for system, row in rows.items())
    print(f"  {length:>4} steps, CPU per step, worker + Postgres (ms): {cpu}")


def _print_continuation(length: int, figures: dict[str, Any]) -> None:
    """How many steps lousho-chain's tasks took, and its step p99 over lousho's against the slice."""
    found, rows = figures["continuation"], figures["systems"]
    verdict = "within" if found["step_p99_within_slice"] else "beyond"
    chain_per_task, strict_per_task = (rows[name].get("steps_per_task") or float("nan") for name in (CHAIN, "lousho"))
    print(
        f"  {length:>4} steps, {CHAIN}: {found['chained_share'] or 0:.1%} of the steps in the same task as the step "
        f"before ({chain_per_task:.2f} steps per task; lousho {strict_per_task:.2f});"
        f" step p99 {rows[CHAIN]['step_p99_ms']:.2f} ms against lousho's {rows['lousho']['step_p99_ms']:.2f} ms:"
        f" {found['step_p99_added_ms']:+.2f} ms, {verdict} the {found['slice_ms']} ms slice"
    )


def _print_event_costs(length: int, costs: dict[str, Any], rows: dict[str, dict[str, Any]]) -> None:
    for name, cost in costs.items():
        system, base = name.split("/")
        per_round = ", ".join(f"{x:.2f}" for x in cost["per_round"])
        verdict = (
            ""
            if "within_target" not in cost
            else ", within the 10% target"
            if cost["within_target"]
            else ", outside the 10% target"
        )
        bare = "".join(
            f"; {s}/bare {cost[f'{s}_over_bare_paired_median']:.3f}x"
            for s in (system, base)
            if f"{s}_over_bare_paired_median" in cost
        )
        print(
            f"  {length:>4} steps, {name} steps/s, paired by round: median {cost['steps_per_s_paired_median']:.3f}x "
            f"({per_round}){verdict}{bare} (paired medians); CPU per step: {cost['cpu']:.3f}x"
        )
        print(
            f"       added by {system} per step: wall {cost['added_wall_ms_per_step']:.2f} ms, "
            f"worker CPU {cost['added_worker_cpu_ms_per_step']:.3f} ms "
            f"(paired median {cost['added_worker_cpu_ms_per_step_paired_median']:.3f}), Postgres CPU "
            f"{cost['added_postgres_cpu_ms_per_step']:.3f} ms (paired median "
            f"{cost['added_postgres_cpu_ms_per_step_paired_median']:.3f})"
        )
    notes = []
    for system, row in rows.items():
        if "events_stored_per_run" in row:
            notes.append(f"{system} {row['events_stored_per_run']:g}")
    line = f"       durable events stored per run: {', '.join(notes)}" if notes else ""
    watched = rows.get("watched")
    if watched and "consumer_cpu_ms_per_step" in watched:
        line += (
            f"; watched runs' consumers saw {watched['events_followed_per_run']:g} events and "
            f"{watched['live_followed_per_run']:g} live signals per run, and used "
            f"{watched['consumer_cpu_ms_per_step']:.3f} ms of CPU per step"
        )
    if line:
        print(line)


def _print_system_table(system: str, lengths: dict[int, dict[str, Any]], sweep: dict[str, Any]) -> None:
    """The per-system table of issue 12: one row per run length, then how the figures change with the length."""
    print(f"\n{system}:")
    print(
        f"| steps per run | steps/s | {system}/bare steps/s | task p50 / p99 (ms) | worker CPU per step (ms) "
        "| Postgres CPU per step (ms) | added CPU per step over bare (ms) | peak worker RSS (MiB) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for length, figures in lengths.items():
        row = figures["systems"].get(system)
        if row is None:
            continue
        ratio = figures["ratios"].get(f"{system}/bare", {}).get("steps_per_s", 1.0 if system == "bare" else None)
        shown = f"{ratio:.2f}x" if ratio is not None else "-"
        added = row.get("added_cpu_ms_per_step_over_bare")
        added_shown = f"{added:.2f}" if added is not None else "-"
        print(
            f"| {length} | {row['steps_per_s']:.1f} | {shown} | {row['task_p50_ms']:.1f} / {row['task_p99_ms']:.1f} "
            f"| {row['worker_cpu_ms_per_step']:.2f} | {row['postgres_cpu_ms_per_step']:.2f} | {added_shown} "
            f"| {row['peak_rss_mib']:.1f} |"
        )
    entry = sweep.get(system)
    if entry and entry["longest"] != entry["shortest"]:
        span = f"at {entry['longest']} / at {entry['shortest']} steps"
        targeted = system == "lousho" and entry["shortest"] == 21  # issue 12's targets, from 21 steps
        ratio_part = (
            f"{system}/bare {span}: {entry['ratio_longest_over_shortest']:.2f}"
            + (" (target >= 0.9)" if targeted else "")
            + "; "
            if "ratio_longest_over_shortest" in entry
            else ""
        )
        print(
            f"{ratio_part}task p99 {span}: {entry['task_p99_longest_over_shortest']:.2f}"
            + (" (target <= 1.5)" if targeted else "")
        )


def report(config: Config, summary: dict[str, Any], rss: dict[str, dict[str, int]]) -> None:
    """Print the summary rows and ratios per run length, one table per system, the load average and peak RSS."""
    lengths: dict[int, dict[str, Any]] = summary["lengths"]
    systems = [
        name
        for name in (CHAIN, "lousho", "ev-off", "watched", "other", "dbos", "floor", "bare")
        if any(name in figures["systems"] for figures in lengths.values())
    ]
    print()
    print(
        f"summary: {config.runs} concurrent runs, {config.rounds} round(s) per run length, prefork -c "
        f"{config.concurrency}, agent {config.agent}, tool results of {config.result_bytes} bytes"
        + (f", other = {config.other_tree}" if config.other_tree else "")
        + (f", DBOS queue polling every {config.dbos_polling_s} s" if "dbos" in systems else "")
    )
    if config.events:
        print("  events: " + "; ".join(EVENT_LEGEND[variant] for variant in config.events))
    if config.continuation:
        print(
            f"  continuation: lousho-chain takes up to {config.continue_steps} steps of a run per task in a slice of"
            f" {config.continue_ms} ms (LOUSHO_CONTINUE_STEPS / LOUSHO_CONTINUE_MS); lousho one step per task"
        )
    print("  steps/s: median of rounds; percentiles over every step of every round (ms); cpu: ms per step")
    print(HEADER)
    for figures in lengths.values():
        for system in systems:
            if system in figures["systems"]:
                print(format_row(figures["systems"][system]))
    for length, figures in lengths.items():
        _print_step_costs(
            length, {system: figures["systems"][system] for system in systems if system in figures["systems"]}
        )
        if "continuation" in figures:
            _print_continuation(length, figures)
        _print_ratios(length, figures["ratios"])
        if "events" in figures:
            _print_event_costs(length, figures["events"], figures["systems"])
    for system in systems:
        _print_system_table(system, lengths, summary["sweep"])
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    for label, peaks in rss.items():
        if peaks:
            parts = ", ".join(f"{role} {kib / 1024:.1f}" for role, kib in peaks.items())
            print(f"peak RSS (VmHWM, MiB) {label} worker: {parts}")


def write_json(
    config: Config,
    results: list[RoundResult],
    summary: dict[str, Any],
    rss: dict[str, dict[str, int]],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the configuration, every round, the summary, the peak RSS and ``extra`` as JSON; return its path."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = Path(config.json_path) if config.json_path else RESULTS / f"bench-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "when": stamp,
        "config": asdict(config) | {"steps_per_run": config.lengths},
        "rounds": [r.summary() for r in results],
        "peak_rss_kib": rss,
        # JSON object keys are strings: the run lengths become "21", "201", ...
        "summary": {"lengths": {str(k): v for k, v in summary["lengths"].items()}, "sweep": summary["sweep"]},
        "host": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
    } | (extra or {})
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path
