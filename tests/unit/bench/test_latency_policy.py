"""`benchmarks.latency_policy`: the real EngineCore on a virtual clock, and the breakdown of
the slowest first tokens it prints."""

from __future__ import annotations

import json

import pytest

from benchmarks.latency_policy import Spec, StepCost, breakdown, main, simulate, summarize
from benchmarks.latency_trace import breakdown as trace_breakdown
from benchmarks.peer_workloads import RequestSpec, Workload
from core_svc.config import CoreConfig
from splitserve_client.bench_serve import RequestResult

COST = StepCost(fixed=0.01, prefill_token=0.001, decode=0.0, context_token=0.0)
"""Round numbers: a step is 10 ms plus 1 ms per prompt token."""


def config(is_async: bool, chunk: int = 0) -> CoreConfig:
    return CoreConfig.of(
        model="bench",
        max_num_seqs=8,
        max_num_batched_tokens=256,
        async_scheduling=is_async,
        adaptive_prefill_chunk=chunk,
        max_recovery_seconds=0.0,
    )


SPECS = [Spec(100, 4, 0.0), Spec(20, 2, 0.05)]
"""A 100-token prompt (a 110 ms step), and a short one that arrives while it runs."""


@pytest.mark.parametrize("is_async", [False, True])
def test_the_parts_of_a_first_token_add_up_to_it(is_async: bool) -> None:
    run = simulate(config(is_async), COST, SPECS)
    late = next(row for row in breakdown(run, 2) if row.handle == run.req_handles[1])
    parts = late.waiting_ms + late.in_flight_ms + late.prefill_ms
    assert parts == pytest.approx(late.ttft_ms)
    assert late.waiting_ms == pytest.approx(60.0), "until the 110 ms step ends"
    assert late.prefill_tokens_ahead == 100 and late.num_chunks == 1
    # async: behind the decode step built ahead without it (10 ms); lockstep: none
    assert late.in_flight_ms == pytest.approx(10.0 if is_async else 0.0, abs=1e-6)


def test_the_adaptive_chunk_admits_the_late_request_into_the_next_step() -> None:
    before = simulate(config(True), COST, SPECS)
    after = simulate(config(True, chunk=64), COST, SPECS)
    assert max(row.in_flight_ms for row in breakdown(before, 2)) > 0
    assert all(row.in_flight_ms == 0 for row in breakdown(after, 2))
    assert summarize(after)["ttft_p99_ms"] < summarize(before)["ttft_p99_ms"]


def test_the_cli_prints_one_row_per_workload_and_the_w3_breakdown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["--workloads", "W3", "--adaptive-prefill-chunks", "0", "192", "--breakdown", "2"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    summaries = [row for row in rows if "workload" in row]
    assert [row["adaptive_prefill_chunk"] for row in summaries] == [0, 192]
    assert sum("slow_ttft" in row for row in rows) == 4
    assert sum("slow_itl" in row for row in rows) == 4


def test_the_real_stack_breakdown_matches_spans_to_the_slowest_client_requests() -> None:
    workload = Workload("W3", (RequestSpec((5,) * 10, 4, 0.0), RequestSpec((6,) * 20, 3, 0.1)))
    results = [
        RequestResult(sent=0.0, token_times=[0.05]),
        RequestResult(sent=0.1, token_times=[0.4]),
    ]
    spans: list[dict[str, float]] = [
        {"prompt_tokens": 20, "completion_tokens": 3, "ttft": 0.29, "queue": 0.1, "prefill": 0.15},
        {"prompt_tokens": 10, "completion_tokens": 4},
    ]
    slow, fast = trace_breakdown(workload, results, spans, 2)
    assert slow == {
        "prompt_tokens": 20,
        "client_ttft_ms": 300.0,
        "ttft_ms": 290.0,
        "queue_ms": 100.0,
        "prefill_ms": 150.0,
        "hops_ms": 40.0,
        "to_client_ms": 10.0,
    }
    assert fast == {"prompt_tokens": 10, "client_ttft_ms": 50.0}, "its span has no latencies"
