"""A KV connector's counters on the core's metrics port, fed by the scheduler's cumulative stats.

vLLM's `vllm:external_prefix_cache_queries/hits` (tokens asked of a peer engine, tokens loaded
from it instead of computed) and splitserve's transfer counters: bytes received, seconds the
loads took, loads finished and loads failed. The same series are on each frontend's serving
port (frontend_svc/engine/engine_stats.py); registered always, as vLLM does, zero without a
connector.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from splitserve_contracts.output_types import SchedulerStats
from splitserve_runtime.kv_metric_names import KV_COUNTERS


class KvConnectorMetrics:
    """The KV_COUNTERS bound to one engine's labels."""

    def __init__(
        self, registry: CollectorRegistry, labels: list[str], values: tuple[str, str]
    ) -> None:
        self._counters = [
            (Counter(name, doc, labels, registry=registry).labels(*values), field)
            for name, doc, field in KV_COUNTERS
        ]

    def observe(self, stats: SchedulerStats, last: SchedulerStats) -> None:
        for counter, field in self._counters:
            now, before = getattr(stats, field), getattr(last, field)
            if now > before:
                counter.inc(now - before)
