"""benchmarks.flag_ab's summary: best of the rounds per side, and the gap between steps."""

from __future__ import annotations

import pytest

from benchmarks.flag_ab import Row, report


def test_the_report_takes_the_best_round_and_the_median_gap(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def row(side: str, tpot: float, tok_s: float, step: float) -> Row:
        return {"side": side, "tpot_ms": tpot, "tok_s": tok_s, "worker_step_ms": step}

    rows = {
        "W2": [row("plain", 14.0, 70.0, 12.0), row("flags", 11.0, 90.0, 10.5)]
        + [row("plain", 13.0, 75.0, 12.5), row("flags", 12.0, 80.0, 11.0)]
        + [row("plain", 20.0, 50.0, 17.0), row("flags", 16.0, 60.0, 15.5)],
        "W1": [row("plain", 60.0, 500.0, 61.0), row("flags", 55.0, 560.0, 56.0)],
    }
    report(rows)
    lines = capsys.readouterr().out.splitlines()
    assert "| W2 | plain | 13.00 | 75.0 | 2.00 |" in lines  # gaps 2.0, 0.5, 3.0
    assert "| W2 | flags | 11.00 | 90.0 | 0.50 |" in lines  # gaps 0.5, 1.0, 0.5
    assert "| W1 | flags | 55.00 | 560.0 | - |" in lines
