"""The engine core's periodic stats line, worded as vLLM's (LoggingStatLogger), so operators'
greps and habits carry over:

    Engine 0: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 8 reqs, Waiting: 2 reqs, CPU KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

(one line). Every `--log-stats-interval` seconds (default 10) while the engine is busy, plus one
line when it falls idle; silent while idle. Prompt throughput counts a prompt when its first token
is sampled, as vLLM does; the hit rate is over the interval's prefix-cache queries (the previous
rate when there were none). The KV cache is "GPU" or "CPU" after the workers' device.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from splitserve_contracts.output_types import SchedulerStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Mark:
    """The cumulative counters at the previous line."""

    time: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class StatsLogger:
    """Turns scheduler snapshots taken every interval into vLLM's stats line."""

    def __init__(self, engine_id: str, device_type: str, now: float) -> None:
        self.engine_id = engine_id
        self.kv_word = "CPU" if device_type == "cpu" else "GPU"
        self._mark = _Mark(now)
        self._was_busy = False
        self._hit_rate = 0.0

    def line(self, stats: SchedulerStats, now: float) -> str | None:
        """The line for the interval that ends now, or None when it and the previous one were
        idle."""
        last, elapsed = self._mark, max(now - self._mark.time, 1e-9)
        num_prompt = stats.num_prompt_tokens - last.num_prompt_tokens
        num_generation = stats.num_generation_tokens - last.num_generation_tokens
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        if queries > 0:
            hits = stats.prefix_cache_hits - last.prefix_cache_hits
            self._hit_rate = 100.0 * hits / queries
        self._mark = _Mark(
            now,
            stats.num_prompt_tokens,
            stats.num_generation_tokens,
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
        )
        is_busy = bool(
            num_prompt or num_generation or stats.num_running_reqs or stats.num_waiting_reqs
        )
        was_busy, self._was_busy = self._was_busy, is_busy
        if not (is_busy or was_busy):
            return None
        return (
            f"Engine {self.engine_id}: "
            f"Avg prompt throughput: {num_prompt / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {num_generation / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
            f"{self.kv_word} KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {self._hit_rate:.1f}%"
        )


@dataclass(frozen=True, slots=True)
class _SpecMark:
    time: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    per_pos: tuple[int, ...] = ()


class SpecDecodingLogger:
    """vLLM's SpecDecodingLogging line, for the interval since the previous one (None when the
    interval verified no draft):

        SpecDecoding metrics: Mean acceptance length: 2.41, Accepted throughput: 52.10 tokens/s,
        Drafted throughput: 98.00 tokens/s, Accepted: 521 tokens, Drafted: 980 tokens,
        Per-position acceptance rate: 0.702, 0.551, 0.412, Avg Draft acceptance rate: 53.2%
    """

    def __init__(self, now: float) -> None:
        self._mark = _SpecMark(now)

    def line(self, stats: SchedulerStats, now: float) -> str | None:
        last = self._mark
        per_pos = tuple(stats.spec_decode_num_accepted_tokens_per_pos)
        self._mark = _SpecMark(
            now,
            stats.spec_decode_num_drafts,
            stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens,
            per_pos,
        )
        num_drafts = stats.spec_decode_num_drafts - last.num_drafts
        if num_drafts <= 0:
            return None
        elapsed = max(now - last.time, 1e-9)
        drafted = stats.spec_decode_num_draft_tokens - last.num_draft_tokens
        accepted = stats.spec_decode_num_accepted_tokens - last.num_accepted_tokens
        before = last.per_pos or (0,) * len(per_pos)
        rates = ", ".join(
            f"{(n - b) / num_drafts:.3f}" for n, b in zip(per_pos, before, strict=True)
        )
        return (
            f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / num_drafts:.2f}, "
            f"Accepted throughput: {accepted / elapsed:.2f} tokens/s, "
            f"Drafted throughput: {drafted / elapsed:.2f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
            f"Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {100.0 * accepted / max(drafted, 1):.1f}%"
        )


async def log_stats_every(
    interval: float, stats_logger: StatsLogger, latest: Callable[[], SchedulerStats]
) -> None:
    """Log `stats_logger`'s line for `latest()` every `interval` seconds (until cancelled),
    and the speculative-decoding line when drafts were verified."""
    spec_logger = SpecDecodingLogger(time.monotonic())
    while True:
        await asyncio.sleep(interval)
        stats, now = latest(), time.monotonic()
        for text in (stats_logger.line(stats, now), spec_logger.line(stats, now)):
            if text is not None:
                logger.info("%s", text)
