"""The engine's load as the gateway contract reports it (GetLoads, and the load record on every
KV-event batch): the core's scheduler counts, plus rates this frontend derives from the core's
cumulative counters (tokens generated per second, recent prefix-cache hit rate) and the queued
prompt work those imply, the fields smg's load-aware policies read."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from frontend_svc.engine.engine_types import EngineInfo
from splitserve_contracts.output_types import SchedulerStats
from splitserve_runtime.engine_option_rules import lora_slots

RATE_WINDOW_S = 2.0
"""Rates are measured over the last this many seconds of samples (smg's THROUGHPUT_WINDOW)."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    num_running: int
    num_waiting: int
    token_usage: float
    num_used_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    gen_throughput: float
    cache_hit_rate: float
    num_waiting_uncached_tokens: int
    num_running_adapters: int = 0
    """Distinct LoRA adapters among the running requests (each holds a worker slot)."""
    lora_slots: int = 0
    """The engine's LoRA slots (vLLM's --max-loras); 0: LoRA is off."""


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float
    generated: int
    queries: int
    hits: int


class LoadReporter:
    """Reads the latest scheduler stats (`stats`) and keeps the samples the rates need."""

    def __init__(
        self,
        info: EngineInfo,
        stats: Callable[[], SchedulerStats],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.info = info
        self._stats = stats
        self._clock = clock
        self._samples: deque[_Sample] = deque()

    def load(self) -> EngineLoad:
        stats = self._stats()
        now = self._clock()
        samples = self._samples
        if samples and stats.step_id and stats.num_generation_tokens < samples[-1].generated:
            samples.clear()  # a new engine core counts from 0 again
        samples.append(
            _Sample(now, stats.num_generation_tokens, stats.prefix_cache_queries,
                    stats.prefix_cache_hits)
        )  # fmt: skip
        while len(samples) > 2 and now - samples[1].at >= RATE_WINDOW_S:
            samples.popleft()
        first, last = samples[0], samples[-1]
        elapsed = last.at - first.at
        gen_throughput = (last.generated - first.generated) / elapsed if elapsed > 0 else 0.0
        queries = last.queries - first.queries
        hit_rate = (last.hits - first.hits) / queries if queries > 0 else 0.0
        capacity = max(0, self.info.num_kv_blocks - 1) * self.info.options.cache.block_size
        usage = min(1.0, max(0.0, stats.kv_cache_usage))
        return EngineLoad(
            num_running=stats.num_running_reqs,
            num_waiting=stats.num_waiting_reqs,
            token_usage=usage,
            num_used_tokens=round(usage * capacity),
            max_total_num_tokens=capacity,
            max_running_requests=self.info.options.scheduler.max_num_seqs,
            gen_throughput=max(0.0, gen_throughput),
            cache_hit_rate=min(1.0, max(0.0, hit_rate)),
            num_waiting_uncached_tokens=round(stats.num_waiting_tokens * (1.0 - hit_rate)),
            num_running_adapters=len(stats.running_lora_adapters),
            lora_slots=lora_slots(self.info.options.lora),
        )
