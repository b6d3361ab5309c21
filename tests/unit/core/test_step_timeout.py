"""StepTimeout: how long a step may take before its rank counts as hung (issue 11, item 5: a
SIGSTOPped worker went unnoticed for the fixed 300 s timeout). The timeout follows the recent
step times of that size, never drops below the floor, and is generous only before any step ran."""

from __future__ import annotations

import pytest

from core_svc.executor.step_timeout import StepTimeout


def test_before_any_step_the_first_step_allowance_applies() -> None:
    timeout = StepTimeout(floor_seconds=5.0, multiple=10.0, first_step_seconds=300.0)
    assert timeout.seconds(1) == 300.0 and timeout.seconds(4096) == 300.0


def test_the_timeout_is_a_multiple_of_the_recent_steps_of_that_size() -> None:
    timeout = StepTimeout(floor_seconds=0.5, multiple=10.0, first_step_seconds=300.0)
    for _ in range(50):
        timeout.observe(num_tokens=8, seconds=0.2)
    assert timeout.seconds(8) == pytest.approx(10.0 * 0.2)  # not 300 s once decode steps are known
    timeout.observe(num_tokens=8, seconds=0.9)  # one slow step among many sets the p99
    assert 2.0 <= timeout.seconds(8) <= 10.0 * 0.9


def test_a_size_never_seen_borrows_the_slowest_time_per_token() -> None:
    timeout = StepTimeout(floor_seconds=0.5, multiple=10.0, first_step_seconds=300.0)
    timeout.observe(num_tokens=16, seconds=0.16)  # 10 ms per token
    # A big prefill gets a long timeout.
    assert timeout.seconds(2048) == pytest.approx(10.0 * 0.01 * 2048)


def test_the_floor_holds_for_tiny_steps() -> None:
    timeout = StepTimeout(floor_seconds=5.0, multiple=10.0, first_step_seconds=300.0)
    timeout.observe(num_tokens=1, seconds=0.001)
    assert timeout.seconds(1) == 5.0
