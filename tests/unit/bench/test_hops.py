"""benchmarks.hops reads per-step means out of the services' real Prometheus expositions."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from benchmarks.hops import histogram_totals, per_step_ms


def exposition(worker_steps: list[tuple[str, float]], hops: list[float]) -> str:
    registry = CollectorRegistry()
    step = Histogram(
        "splitserve_worker_step_seconds", "", ["model_name", "phase"], registry=registry
    )
    hop = Histogram("splitserve_core_worker_hop_seconds", "", registry=registry)
    for phase, seconds in worker_steps:
        step.labels(model_name="m", phase=phase).observe(seconds)
    for seconds in hops:
        hop.observe(seconds)
    return generate_latest(registry).decode()


def test_per_step_means_cover_only_what_was_observed_between_scrapes() -> None:
    before = histogram_totals(exposition([("total", 1.0), ("forward", 0.5)], [0.1]))
    after = histogram_totals(
        exposition(
            [("total", 1.0), ("forward", 0.5), ("total", 0.02), ("total", 0.04), ("forward", 0.01)],
            [0.1, 0.002, 0.004, 0.006],
        )
    )
    means = per_step_ms(before, after)
    assert means["worker_total_ms"] == pytest.approx(30.0)
    assert means["worker_forward_ms"] == pytest.approx(10.0)
    assert means["core_worker_hop_ms"] == pytest.approx(4.0)
    assert "worker_sample_ms" not in means, "never observed"


def test_a_histogram_unchanged_between_scrapes_is_left_out() -> None:
    text = exposition([("total", 1.0)], [0.1])
    assert per_step_ms(histogram_totals(text), histogram_totals(text)) == {}
