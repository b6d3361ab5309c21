"""The core's metrics port counts a KV connector's work from the scheduler's cumulative stats."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from core_svc.metrics import CoreMetrics
from splitserve_contracts.output_types import SchedulerStats


def _values(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.endswith("_total")
    }


def test_kv_counters_follow_the_cumulative_stats_and_never_go_back() -> None:
    registry = CollectorRegistry()
    metrics = CoreMetrics(registry, "m", "0", {"engine": "0"})
    assert _values(registry)["vllm:external_prefix_cache_hits_total"] == 0  # always exported
    first = SchedulerStats(
        external_prefix_cache_queries=300,
        external_prefix_cache_hits=299,
        kv_transfer_received_bytes=6_900_000,
        kv_transfer_seconds=0.5,
        kv_transfer_num_loads=1,
    )
    metrics.observe_stats(first, None)
    metrics.observe_stats(SchedulerStats(kv_transfer_num_failed_loads=1), None)  # a restart
    metrics.observe_stats(
        SchedulerStats(external_prefix_cache_queries=10, kv_transfer_num_failed_loads=2), None
    )
    values = _values(registry)
    assert values["vllm:external_prefix_cache_queries_total"] == 310
    assert values["vllm:external_prefix_cache_hits_total"] == 299
    assert values["splitserve:kv_transfer_received_bytes_total"] == 6_900_000
    assert values["splitserve:kv_transfer_seconds_total"] == 0.5
    assert values["splitserve:kv_transfer_loads_total"] == 1
    assert values["splitserve:kv_transfer_failed_loads_total"] == 2
