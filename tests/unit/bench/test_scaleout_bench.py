"""The scale-out benchmark's pure parts (benchmarks/scaleout*.py): the rate sweep (from the
reference rate up while TTFT p90 holds, down where it does not), the workloads' shapes, the
oracle hit rate over the prompts a run sent, and the tables and targets from a run's results."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest

from benchmarks.scaleout import below_reference, run_sweep, schedule
from benchmarks.scaleout_client import RunStats
from benchmarks.scaleout_oracle import oracle_hit_rate
from benchmarks.scaleout_report import headline, render
from benchmarks.scaleout_workload import FULL, SCALED, Shape, no_sharing, returning, sp_mt

RATES = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
WORDS = [f"w{i}" for i in range(50)]


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


def test_rounds_alternate_so_a_rounds_last_variant_runs_first_in_the_next() -> None:
    order = schedule(["a", "b", "c"], 3)
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                     (2, "a"), (2, "b"), (2, "c")]  # fmt: skip


def test_points_below_the_reference_rate_keep_every_group_with_fewer_sessions() -> None:
    assert below_reference(SCALED, 1.4 / 1.4) == SCALED
    assert below_reference(SCALED, 1.0 / 1.4).sessions_per_group == 3
    low = below_reference(SCALED, 0.5 / 1.4)
    assert low.sessions_per_group == 2 and low.num_groups == SCALED.num_groups


def test_the_scaled_workload_keeps_the_full_ones_ideal_hit_rate() -> None:
    assert FULL.num_requests == 192 and FULL.working_set_tokens() == 32_768
    assert SCALED.num_requests == 96 and SCALED.working_set_tokens() == 8_192
    assert FULL.ideal_hit_rate() == pytest.approx(1 - 32_768 / 227_328)
    assert SCALED.ideal_hit_rate() == pytest.approx(FULL.ideal_hit_rate())


def test_workloads_have_the_shapes_prompt_lengths() -> None:
    shape = Shape("t", 2, 2, 3, 10, 4, 2)
    workload = sp_mt(WORDS, 1.0, 0, shape)
    assert len(workload.order) == shape.num_requests == 12
    assert len({s.system for s in workload.sessions}) == 2
    control = no_sharing(WORDS, 1.0, 0, shape, 6)
    lengths = sorted(len((s.system + " " + s.turns[0].user).split()) for s in control.sessions)
    assert lengths == sorted([shape.prompt_tokens(t) for t in range(3)] * 2)
    back = returning(WORDS, workload, 1.0, 0, shape)
    assert {s.system for s in back.sessions} == {s.system for s in workload.sessions}
    assert len(back.order) == shape.num_sessions


def _encode_words(messages: list[dict[str, str]]) -> list[int]:
    """A chat template of its own: each word a token, a marker token per message."""
    ids: list[int] = []
    for message in messages:
        ids += [-1, *(WORDS.index(w) for w in message["content"].split())]
    return ids


def test_the_oracle_hits_what_an_earlier_prompt_holds_in_whole_blocks() -> None:
    shape = Shape("t", 1, 2, 1, 32, 8, 2)  # two sessions sharing a 32-word system prompt
    workload = sp_mt(WORDS, 1.0, 0, shape)
    # each prompt: 1 + 32 + 1 + 8 = 42 tokens; the second hits the first's two full 16-token
    # blocks (the system prompt's first 31 words and its marker), no more
    assert oracle_hit_rate(workload, _encode_words, block_size=16) == pytest.approx(32 / 84)


def _stats(rate: float, hit: float, p50: float, p90: float, tok_s: float) -> dict[str, float]:
    return asdict(RunStats(rate, hit, p50, p90, tok_s, 0))


def _runs() -> list[dict[str, object]]:
    fault = {"fault": "worker", "running_at_kill": 2, "serving_again_s": 4.0,
             "kv_usage_after": 0.0,
             "outcomes": {"complete": 31, "error": 1, "truncated": 0, "hung": 0}}  # fmt: skip
    rr = {"variant": "round_robin", "reference": _stats(1, 0.3, 2.0, 5.0, 10.0),
          "sweep": [_stats(1, 0.3, 2.0, 5.0, 10.0), _stats(0.5, 0.3, 1.0, 1.5, 5.0)],
          "control": _stats(8, 0, 9, 9, 20.0),
          "core-fault": {**fault, "fault": "core"}}  # fmt: skip
    ev = {"variant": "cache_aware+events", "reference": _stats(1, 0.85, 0.3, 0.6, 10.0),
          "sweep": [_stats(1, 0.85, 0.3, 0.6, 10.0), _stats(2, 0.85, 0.5, 3.0, 20.0)],
          "control": _stats(8, 0, 9, 9, 20.5), "oracle_hit_rate": 0.84,
          "divergence": {"fault": fault, "returning": _stats(1, 0.9, 0.2, 0.3, 10)},
          "routing": {"direct_p50_ms": 20, "direct_p99_ms": 30, "gateway_p50_ms": 20.5,
                      "gateway_p99_ms": 32, "added_p50_ms": 0.5, "added_p99_ms": 2}}  # fmt: skip
    noev = {"variant": "cache_aware-no-events", "reference": _stats(1, 0.8, 0.3, 0.7, 10.0),
            "divergence": {"fault": fault, "returning": _stats(1, 0.7, 0.4, 0.5, 10)}}  # fmt: skip
    vllm = {"variant": "vllm:cache_aware+events", "error": "did not start"}
    return [rr, ev, noev, vllm]


def test_headline_takes_the_highest_sustained_rate_and_dashes_what_was_not_run() -> None:
    rr, ev, noev, _ = _runs()
    assert headline(rr)["max_rate"] == 0.5 and headline(ev)["max_rate"] == 1.0
    assert math.isnan(headline(noev)["max_rate"]) and math.isnan(headline(noev)["control_tok_s"])


def test_the_report_checks_every_target_against_the_runs() -> None:
    table = render(_runs(), SCALED, 1.0)
    row = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()}
    assert "| 0.15x | yes |" in row["TTFT p50 <= 0.25x round-robin"]
    assert "| 2.00x | yes |" in row["sustainable rate >= 2x round-robin"]
    assert "| 1.025x | yes |" in row["no-sharing control within 5 % of round-robin"]
    assert "| +20.0% hit rate | yes |" in row["event-fed beats event-less after a divergence"]
    assert row["throughput >= 1.0x vLLM-CPU's"].endswith("| – | – |")  # the anchor failed
    assert "| 0.50 ms | yes |" in row["routing adds <= 1 ms p50"]
    assert "| 0 | yes |" in row["lost engine: 0 hung, 0 truncated"]
    assert "| cache_aware+events | worker | 2 | 31 | 1 | 0 | 0 | 4.0 | 0.000 |" in table
    assert "| round_robin | core | 2 |" in table
