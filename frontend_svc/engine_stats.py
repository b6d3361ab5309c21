"""The engine core's queue and KV-cache gauges, exported by the frontend on its /metrics.

A router or autoscaler scraping the serving port (the production-stack router, KEDA, the llm-d
endpoint picker) reads vLLM's names there: vllm:num_requests_running, vllm:num_requests_waiting,
vllm:kv_cache_usage_perc and vllm:cache_config_info, labelled with model_name and the engine's
id, and with --enable-lora vllm:lora_requests_info (the LoRA-affinity scorer's input). The values are the core's SchedulerStats as of the latest step that sent this frontend
outputs, or, when none did for a second (this frontend idle while others keep the engine busy),
as the frontend last asked the core for them; read at scrape time, so serving pays nothing. Several frontends on one core export the
same series with the same `engine` label: aggregate with max by engine, never sum.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from frontend_svc.engine_types import EngineInfo
from splitserve_contracts.output_types import SchedulerStats

LABELS = ["model_name", "engine"]


def cache_config_labels(info: EngineInfo) -> dict[str, str]:
    """vllm:cache_config_info's labels (vLLM's CacheConfig names) from the engine's facts."""
    return {
        "engine": info.engine_id,
        "block_size": str(info.block_size),
        "num_gpu_blocks": str(info.num_kv_blocks),
        "enable_prefix_caching": str(info.enable_prefix_caching),
        "cache_dtype": "auto",
    }


class EngineStatsCollector:
    """A Prometheus collector over a function returning the latest SchedulerStats."""

    def __init__(
        self, latest: Callable[[], SchedulerStats], model_name: str, info: EngineInfo
    ) -> None:
        self.latest = latest
        self.values = [model_name, info.engine_id]
        self.cache_config = cache_config_labels(info)
        self.max_loras = info.max_loras

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.values, value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self.latest()
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            stats.num_running_reqs,
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            stats.num_waiting_reqs,
        )  # fmt: skip
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.kv_cache_usage,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=sorted(self.cache_config),
        )
        info.add_metric([self.cache_config[k] for k in sorted(self.cache_config)], 1.0)
        yield info
        if self.max_loras:
            yield lora_requests_info(stats, self.max_loras)


LORA_INFO_LABELS = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]


def lora_requests_info(stats: SchedulerStats, max_loras: int) -> GaugeMetricFamily:
    """vLLM's vllm:lora_requests_info (only with --enable-lora): the adapters of the running
    and of the waiting requests, comma-separated, as labels, and the time as the value (a
    consumer such as llm-d's LoRA-affinity scorer takes the newest series)."""
    family = GaugeMetricFamily(
        "vllm:lora_requests_info", "Running stats on lora requests.", labels=LORA_INFO_LABELS
    )
    labels = [
        str(max_loras),
        ",".join(stats.waiting_lora_adapters),
        ",".join(stats.running_lora_adapters),
    ]
    family.add_metric(labels, time.time())
    return family


def register_engine_stats(
    registry: CollectorRegistry,
    latest: Callable[[], SchedulerStats],
    model_name: str,
    info: EngineInfo,
) -> None:
    registry.register(EngineStatsCollector(latest, model_name, info))
