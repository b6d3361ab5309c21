"""The engine core's vLLM-style stats line: throughput from the scheduler's cumulative token
counts, every interval while busy, one line when it falls idle, silent while idle."""

from __future__ import annotations

import asyncio
import logging

import pytest

from core_svc.stats_logger import StatsLogger, log_stats_every
from splitserve_contracts.output_types import SchedulerStats
from tests.unit.core.fake_executor import make_engine, make_request, run_to_completion

VLLM_LINE = (
    "Engine 0: Avg prompt throughput: {:.1f} tokens/s, Avg generation throughput: {:.1f} "
    "tokens/s, Running: {} reqs, Waiting: {} reqs, {} KV cache usage: {:.1f}%, "
    "Prefix cache hit rate: {:.1f}%"
)


def test_the_scheduler_counts_prompts_at_their_first_token_and_every_sampled_token() -> None:
    engine, _ = make_engine(num_blocks=64, max_num_batched_tokens=8)
    engine.add_request(make_request(1, list(range(20)), max_tokens=5))  # a chunked prefill
    engine.step()
    assert (engine.make_stats().num_prompt_tokens, engine.make_stats().num_generation_tokens) == (
        0,
        0,
    )
    engine.add_request(make_request(2, list(range(30, 36)), max_tokens=3))
    run_to_completion(engine)
    stats = engine.make_stats()
    assert stats.num_prompt_tokens == 20 + 6
    assert stats.num_generation_tokens == 5 + 3


def test_busy_intervals_log_vllms_line_with_rates_over_the_interval() -> None:
    stats_logger = StatsLogger("0", "cpu", now=100.0)
    busy = SchedulerStats(
        num_running_reqs=3,
        num_waiting_reqs=2,
        kv_cache_usage=0.125,
        prefix_cache_queries=200,
        prefix_cache_hits=50,
        num_prompt_tokens=1000,
        num_generation_tokens=300,
    )
    assert stats_logger.line(busy, 110.0) == VLLM_LINE.format(100.0, 30.0, 3, 2, "CPU", 12.5, 25.0)
    later = SchedulerStats(
        num_running_reqs=1,
        kv_cache_usage=0.5,
        prefix_cache_queries=300,
        prefix_cache_hits=150,
        num_prompt_tokens=1200,
        num_generation_tokens=400,
    )
    assert stats_logger.line(later, 115.0) == VLLM_LINE.format(40.0, 20.0, 1, 0, "CPU", 50.0, 100.0)


def test_one_line_when_the_engine_falls_idle_then_silence() -> None:
    stats_logger = StatsLogger("0", "cuda", now=0.0)
    done = SchedulerStats(num_prompt_tokens=10, num_generation_tokens=10)
    assert stats_logger.line(SchedulerStats(), 10.0) is None  # idle from the start: silent
    assert stats_logger.line(done, 20.0) == VLLM_LINE.format(1.0, 1.0, 0, 0, "GPU", 0.0, 0.0)
    assert stats_logger.line(done, 30.0) == VLLM_LINE.format(0.0, 0.0, 0, 0, "GPU", 0.0, 0.0)
    assert stats_logger.line(done, 40.0) is None
    assert stats_logger.line(done, 50.0) is None
    waiting = SchedulerStats(num_waiting_reqs=1, num_prompt_tokens=10, num_generation_tokens=10)
    assert stats_logger.line(waiting, 60.0) is not None  # queued work is busy, even at 0 tokens/s


def test_the_hit_rate_keeps_its_last_value_through_intervals_without_queries() -> None:
    stats_logger = StatsLogger("0", "cpu", now=0.0)
    first = SchedulerStats(num_running_reqs=1, prefix_cache_queries=10, prefix_cache_hits=4)
    assert stats_logger.line(first, 1.0) is not None
    text = stats_logger.line(first, 2.0)
    assert text is not None and text.endswith("Prefix cache hit rate: 40.0%")


def test_the_task_logs_through_the_core_logger(caplog: pytest.LogCaptureFixture) -> None:
    idle = SchedulerStats(num_generation_tokens=5)  # counters are cumulative
    snapshots = iter([SchedulerStats(num_running_reqs=1, num_generation_tokens=5)] + [idle] * 50)
    latest = idle

    def take() -> SchedulerStats:
        nonlocal latest
        latest = next(snapshots, latest)
        return latest

    async def scenario() -> None:
        task = asyncio.create_task(log_stats_every(0.01, StatsLogger("0", "cpu", 0.0), take))
        await asyncio.sleep(0.3)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="core_svc.stats_logger"):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.name == "core_svc.stats_logger"]
    assert len(lines) == 2 and all("Avg prompt throughput" in line for line in lines)
    assert "Running: 1 reqs" in lines[0] and "Running: 0 reqs" in lines[1]
