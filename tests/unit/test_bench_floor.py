"""``--floor`` adds the protocol floor as a system of the bare chain's worker, and the report sets Lousho against it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import floor
from bench.config import parse_args
from bench.report import aggregate
from bench.results import RoundResult
from bench.run import Bench


def _round(system: str, number: int, steps_per_s: float) -> RoundResult:
    return RoundResult(
        system,
        number,
        100,
        100 / steps_per_s,
        steps_per_s,
        [1.0] * 100,
        [1.0] * 100,
        [0.5] * 10,
        worker_cpu_s=0.2,
        steps_per_run=21,
    )


def test_the_floor_runs_on_the_bare_workers_app_with_its_switch_on(tmp_path: Path) -> None:
    systems = {system.name: system for system in Bench(parse_args(["--floor"]), tmp_path).systems}
    assert systems["floor"].kind == "bare" and systems["floor"].app == "bench.bare"
    assert dict(systems["floor"].env) == {floor.ENV: "1"}
    assert systems["floor"].queue != systems["bare"].queue
    assert "floor" not in {system.name for system in Bench(parse_args([]), tmp_path).systems}


def test_the_floors_postgres_cpu_is_read_from_the_bench_database(tmp_path: Path) -> None:
    bench = Bench(parse_args(["--floor"]), tmp_path)
    systems = {system.name: system for system in bench.systems}
    assert bench.database_of(systems["floor"]) == bench.config.database
    assert bench.database_of(systems["lousho"]) == bench.config.database
    assert bench.database_of(systems["bare"]) is None


def test_the_floor_is_not_measured_beside_the_rss_rounds() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--floor", "--rss-steps", "100"])


def test_the_report_gives_floor_over_bare_and_lousho_over_floor() -> None:
    results = [
        _round(system, number, rate)
        for number in (1, 2)
        for system, rate in (("lousho", 200.0), ("floor", 250.0), ("bare", 400.0))
    ]
    ratios = aggregate(results, {})["lengths"][21]["ratios"]
    assert ratios["floor/bare"]["steps_per_s"] == 0.625
    assert ratios["lousho/floor"]["steps_per_s"] == 0.8
