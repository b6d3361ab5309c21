"""The scale-out benchmark's rate sweep: from the reference rate up while TTFT p90 holds, down
where it does not (benchmarks/scaleout.py)."""

from __future__ import annotations

import math

from benchmarks.scaleout import headline, render, run_sweep
from benchmarks.scaleout_client import RunStats

RATES = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]


def _runner(max_sustained: float, asked: list[float]):  # type: ignore[no-untyped-def]
    def at(rate: float) -> RunStats:
        asked.append(rate)
        p90 = 1.0 if rate <= max_sustained else 5.0
        return RunStats(rate, 0.5, 0.5, p90, 10.0 * rate, 0)

    return at


def test_goes_up_from_the_reference_until_the_bound_breaks() -> None:
    asked: list[float] = []
    sweep = run_sweep(RATES, 1.0, _runner(2.0, asked))
    assert asked == [1.0, 2.0, 4.0]
    assert [s.rate for s in sweep] == [1.0, 2.0, 4.0]


def test_goes_down_when_the_reference_rate_is_not_sustained() -> None:
    asked: list[float] = []
    sweep = run_sweep(RATES, 1.0, _runner(0.25, asked))
    assert asked == [1.0, 0.5, 0.25]
    assert [s.rate for s in sweep] == [0.25, 0.5, 1.0]


def test_nothing_sustained_tries_every_lower_rate() -> None:
    asked: list[float] = []
    run_sweep(RATES, 1.0, _runner(0.0, asked))
    assert asked == [1.0, 0.5, 0.25]


def test_a_run_without_control_renders_a_dash() -> None:
    at = RunStats(1.0, 0.8, 0.2, 0.4, 30.0, 0)
    run = {"sweep": [at.__dict__], "control": None}
    row = headline(run, 1.0)
    assert row["max_rate"] == 1.0 and math.isnan(row["control_tok_s"])
    table = render({"cache_aware-no-events": [row]}, 1.0)
    assert table.splitlines()[-1].endswith("| 1 | – |")
