"""``python -m bench --continue on,off``: the chained worker measured beside the strict one, and its ratios."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.config import parse_args
from bench.report import aggregate
from bench.results import RoundResult, Span, chained_steps, gaps_ms, steps_taken
from bench.run import CHAIN, Bench, chain_system
from bench.workers import BenchError


def _round(
    system: str, number: int, steps_per_s: float, cpu_s: float, step_ms: float = 1.0, chained: int | None = None
) -> RoundResult:
    steps = 100
    return RoundResult(
        system,
        number,
        steps,
        steps / steps_per_s,
        steps_per_s,
        [step_ms] * steps,
        [1.0] * (steps - (chained or 0)),
        [0.5] * 10,
        worker_cpu_s=cpu_s,
        steps_per_run=21,
        chained_steps=chained,
    )


def test_continue_on_off_measures_the_chained_worker_beside_the_strict_one(tmp_path: Path) -> None:
    config = parse_args(["--continue", "off,on", "--continue-steps", "50", "--continue-ms", "20"])
    assert config.continuation == ("on", "off")
    assert (config.continue_steps, config.continue_ms) == (50, 20)
    chained = chain_system(config)
    assert chained.name == CHAIN and chained.queue != "bench-lousho"
    assert dict(chained.env) == {"LOUSHO_CONTINUE_STEPS": "50", "LOUSHO_CONTINUE_MS": "20"}
    names = [system.name for system in Bench(config, tmp_path).systems]
    assert names == [CHAIN, "lousho", "bare"]


def test_continue_defaults_to_a_thousand_steps_in_a_100_ms_slice(tmp_path: Path) -> None:
    config = parse_args(["--continue", "on"])
    assert (config.continuation, config.continue_steps, config.continue_ms) == (("on",), 1000, 100)
    assert [system.name for system in Bench(config, tmp_path).systems] == [CHAIN, "bare"]
    assert parse_args([]).continuation == ()


@pytest.mark.parametrize(
    "argv",
    [
        ["--continue", "sideways"],
        ["--continue", "on", "--events", "on,off"],
        ["--continue", "on", "--continue-steps", "1"],
        ["--continue", "on", "--continue-ms", "0"],
    ],
)
def test_continue_refuses_what_it_cannot_measure(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_the_summary_gives_the_chained_worker_its_ratios_against_bare_dbos_and_strict() -> None:
    results = []
    for number in (1, 2):
        results += [
            _round(CHAIN, number, 900.0, 0.1, chained=80),
            _round("lousho", number, 300.0, 0.4, chained=0),
            _round("dbos", number, 360.0, 0.2),
            _round("bare", number, 600.0, 0.2),
        ]
    figures = aggregate(results, {})["lengths"][21]
    ratios = figures["ratios"]
    assert ratios[f"{CHAIN}/bare"]["steps_per_s"] == 1.5
    assert ratios[f"{CHAIN}/bare"]["paired_median"] == 1.5
    assert ratios[f"{CHAIN}/dbos"]["steps_per_s"] == 2.5
    assert ratios[f"{CHAIN}/lousho"]["steps_per_s"] == 3.0
    assert ratios[f"{CHAIN}/dbos"]["cpu"] == 2.0  # dbos's CPU per step over the chain's
    assert set(figures["systems"][CHAIN]) == set(figures["systems"]["lousho"])
    assert figures["systems"][CHAIN]["steps_per_task"] == 5.0
    assert figures["systems"]["lousho"]["chained_share"] == 0


def test_the_chained_step_p99_is_held_to_the_strict_one_plus_the_slice() -> None:
    results = [_round(CHAIN, 1, 900.0, 0.1, step_ms=150.0, chained=80), _round("lousho", 1, 300.0, 0.4, step_ms=80.0)]
    within = aggregate(results, {}, slice_ms=100)["lengths"][21]["continuation"]
    beyond = aggregate(results, {}, slice_ms=50)["lengths"][21]["continuation"]
    assert within["step_p99_added_ms"] == 70.0 and within["step_p99_within_slice"]
    assert not beyond["step_p99_within_slice"]
    assert "continuation" not in aggregate(results, {})["lengths"][21]


def test_steps_saved_inside_one_task_count_as_chained_and_its_gap_is_found_past_them() -> None:
    # Given a run whose first task (seq 0) saved steps 0-2 and whose second (seq 3) saved steps 3-4
    tasks: dict[str, list[Span]] = {"r": [(10.0, 10.3, 0), (10.4, 10.6, 3)]}
    saves = {"r": [10.1, 10.2, 10.3, 10.5, 10.6]}
    # When the steps each task took are counted
    taken = steps_taken(tasks, saves)
    # Then three of the five steps followed a step of the same task, and the gap is between the two tasks
    assert taken == {"r": [3, 2]}
    assert chained_steps(taken) == 3
    assert gaps_ms(tasks, taken) == pytest.approx([100.0])
    assert gaps_ms(tasks) == []


def test_a_save_of_the_next_task_before_the_previous_task_ended_counts_for_the_next_task() -> None:
    # Given a strict run whose task 1 published its next step, and the next task saved it before task 1's span
    # ended (task 1 was still finishing after its publish), as in a measured round (seq 600 and 601 of 601r2-000)
    tasks: dict[str, list[Span]] = {"r": [(29.6813, 29.6985, 599), (29.6900, 29.7010, 600)]}
    saves = {"r": [29.6851, 29.6979]}
    # When the steps each task took are counted
    taken = steps_taken(tasks, saves)
    # Then each task took its own step: none was chained
    assert taken == {"r": [1, 1]}
    assert chained_steps(taken) == 0


def test_a_save_at_the_next_tasks_start_counts_once_and_a_busy_duplicate_takes_nothing() -> None:
    # Given a save at the very start of the next task, and a duplicate delivery (same seq) dropped as busy
    # inside the first task's span before that task saved
    tie: dict[str, list[Span]] = {"r": [(1.0, 2.0, 0), (1.5, 2.5, 1)]}
    busy: dict[str, list[Span]] = {"r": [(1.0, 2.0, 0), (1.2, 1.3, 0), (2.1, 2.5, 1)]}
    # When the steps each task took are counted
    # Then the save at the tie goes to the task that began there, and the busy drop took no step
    assert steps_taken(tie, {"r": [1.2, 1.5]}) == {"r": [1, 1]}
    assert steps_taken(busy, {"r": [1.8, 2.2]}) == {"r": [1, 0, 1]}
    assert gaps_ms(busy, steps_taken(busy, {"r": [1.8, 2.2]})) == pytest.approx([100.0])


def test_a_chain_worker_that_took_one_step_per_task_fails_the_round(tmp_path: Path) -> None:
    bench = Bench(parse_args(["--continue", "on,off"]), tmp_path)
    chained, strict = bench.systems[0], bench.systems[1]
    with pytest.raises(BenchError, match="LOUSHO_CONTINUE_STEPS=1000 did not apply"):
        bench.check_continuation(chained, _round(CHAIN, 1, 900.0, 0.1, chained=0), "21r1c-")
    with pytest.raises(BenchError, match="one step per task"):
        bench.check_continuation(strict, _round("lousho", 1, 300.0, 0.4, chained=2), "21r1-")
    bench.check_continuation(chained, _round(CHAIN, 1, 900.0, 0.1, chained=80), "21r1c-")
    bench.check_continuation(strict, _round("lousho", 1, 300.0, 0.4, chained=0), "21r1-")
