"""``python -m bench --continue on,off``: the chained worker measured beside the strict one, and its ratios."""

from __future__ import annotations

import pytest

from bench.config import parse_args
from bench.report import aggregate
from bench.results import RoundResult
from bench.run import CHAIN, Bench, chain_system


def _round(system: str, number: int, steps_per_s: float, cpu_s: float) -> RoundResult:
    steps = 100
    return RoundResult(
        system,
        number,
        steps,
        steps / steps_per_s,
        steps_per_s,
        [1.0] * steps,
        [1.0] * 10,
        [0.5] * 10,
        worker_cpu_s=cpu_s,
        steps_per_run=21,
    )


def test_continue_on_off_measures_the_chained_worker_beside_the_strict_one(tmp_path: object) -> None:
    config = parse_args(["--continue", "off,on", "--continue-steps", "50", "--continue-ms", "20"])
    assert config.continuation == ("on", "off")
    chained = chain_system(config)
    assert chained.name == CHAIN and chained.queue != "bench-lousho"
    assert dict(chained.env) == {"LOUSHO_CONTINUE_STEPS": "50", "LOUSHO_CONTINUE_MS": "20"}
    names = [system.name for system in Bench(config, tmp_path).systems]  # type: ignore[arg-type]
    assert names == [CHAIN, "lousho", "bare"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--continue", "sideways"],
        ["--continue", "on", "--events", "on,off"],
        ["--continue", "on", "--continue-steps", "1"],
    ],
)
def test_continue_refuses_what_it_cannot_measure(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_the_summary_gives_the_chained_worker_its_ratios_against_bare_dbos_and_strict() -> None:
    results = []
    for number in (1, 2):
        results += [
            _round(CHAIN, number, 900.0, 0.1),
            _round("lousho", number, 300.0, 0.4),
            _round("dbos", number, 360.0, 0.2),
            _round("bare", number, 600.0, 0.2),
        ]
    ratios = aggregate(results, {})["lengths"][21]["ratios"]
    assert ratios[f"{CHAIN}/bare"]["steps_per_s"] == 1.5
    assert ratios[f"{CHAIN}/dbos"]["steps_per_s"] == 2.5
    assert ratios[f"{CHAIN}/lousho"]["steps_per_s"] == 3.0
    assert ratios[f"{CHAIN}/dbos"]["cpu"] == 2.0  # dbos's CPU per step over the chain's
