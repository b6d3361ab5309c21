"""The engine's series on the frontend's serving port (/metrics of the HTTP API), for gateways.

A router or autoscaler scraping a pod's serving port (the production-stack router, the llm-d
endpoint picker) reads vLLM's engine series there, as from `vllm serve`:
vllm:num_requests_running, vllm:num_requests_waiting (and _by_reason), vllm:kv_cache_usage_perc,
vllm:prefix_cache_queries/hits, vllm:external_prefix_cache_queries/hits and splitserve:kv_transfer_* (a KV connector's),
vllm:num_preemptions, vllm:mm_cache_queries/hits,
vllm:structured_output_cache_queries/hits, vllm:iteration_tokens_total and
vllm:cache_config_info, labelled with model_name and the engine's id, with --enable-lora vllm:lora_requests_info (llm-d's LoRA-affinity scorer's input) and with
--speculative-config vllm:spec_decode_num_drafts/_num_draft_tokens/_num_accepted_tokens/
_num_accepted_tokens_per_pos. They are the engine core's own values, asked for at scrape time
(GetSchedulerStats), or, when the core does not answer within a second, its latest stats this
frontend saw (no histogram then).

One source per series in Prometheus: these are only on the serving port. The engine core's
metrics port exports the same series, and the frontend's metrics port (the one the chart's
ServiceMonitor scrapes) exports only request-level series, which each frontend counts for its
own requests. So `sum(vllm:num_requests_waiting)` over a release is the engine's truth however
many frontends it has (docs/deploy.md#metrics-that-add-up). Scrape a frontend's serving port
with Prometheus only where it is the engine's only exporter (the one-container image).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from frontend_svc.engine.engine_types import EngineInfo, EngineSnapshot
from splitserve_contracts.output_types import SchedulerStats
from splitserve_runtime.engine_option_rules import lora_enabled, lora_slots
from splitserve_runtime.kv_metric_names import KV_COUNTERS

logger = logging.getLogger(__name__)
LABELS = ["model_name", "engine"]
SNAPSHOT_TIMEOUT_S = 1.0
MAX_COUNT = 1 << 53
"""The largest count a Prometheus sample (a float64) holds exactly."""


def cache_config_labels(info: EngineInfo) -> dict[str, str]:
    """vllm:cache_config_info's labels (vLLM's CacheConfig names) from the engine's facts."""
    return {
        "engine": info.engine_id,
        "block_size": str(info.options.cache.block_size),
        "num_gpu_blocks": str(info.num_kv_blocks),
        "enable_prefix_caching": str(info.enable_prefix_caching),
        "cache_dtype": info.options.cache.kv_cache_dtype,
    }


class EngineSeries:
    """vLLM's engine series of one snapshot, as Prometheus metric families."""

    def __init__(self, snapshot: EngineSnapshot, model_name: str, info: EngineInfo) -> None:
        self.snapshot = snapshot
        self.values = [model_name, info.engine_id]
        self.cache_config = cache_config_labels(info)
        self.lora = info.options.lora

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.values, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.values, value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot.stats
        yield from self._scheduler_gauges(stats)
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits,
        )
        yield self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            stats.num_preemptions,
        )
        yield self._counter(
            "vllm:mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items.",
            stats.encoder_cache_queries,
        )
        yield self._counter(
            "vllm:mm_cache_hits",
            "Multi-modal cache hits, in terms of number of cached items.",
            stats.encoder_cache_hits,
        )
        yield from self._external_prefix_cache(stats)
        yield from self._grammar_cache(stats)
        yield from self._iteration_tokens()
        yield from self._spec_decode(stats)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=sorted(self.cache_config),
        )
        info.add_metric([self.cache_config[k] for k in sorted(self.cache_config)], 1.0)
        yield info
        if lora_enabled(self.lora):
            yield lora_requests_info(stats, lora_slots(self.lora))

    def _scheduler_gauges(self, stats: SchedulerStats) -> Iterator[Metric]:
        """Running and waiting requests; waiting for a grammar or for KV from a peer engine
        (vLLM's WAITING_FOR_FSM, WAITING_FOR_REMOTE_KVS: still in its waiting queue) counts
        as waiting, deferred."""
        deferred = stats.num_waiting_deferred + stats.num_waiting_for_remote_kvs
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            stats.num_running_reqs,
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            stats.num_waiting_reqs + deferred,
        )
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason (capacity, deferred).",
            labels=[*LABELS, "reason"],
        )
        by_reason.add_metric([*self.values, "capacity"], stats.num_waiting_reqs)
        by_reason.add_metric([*self.values, "deferred"], deferred)
        yield by_reason
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.kv_cache_usage,
        )

    def _external_prefix_cache(self, stats: SchedulerStats) -> Iterator[Metric]:
        """vLLM's KV-connector counters (tokens asked of a peer engine, tokens loaded from it
        instead of computed: a P/D decode engine's prompts) and the transfers' bytes, seconds,
        loads and failures (splitserve_runtime/kv_metric_names.py), checked as
        _grammar_cache's: at most MAX_COUNT, hits at most the queries."""
        values = {field: min(getattr(stats, field), MAX_COUNT) for _, _, field in KV_COUNTERS}
        hits = "external_prefix_cache_hits"
        values[hits] = min(values[hits], values["external_prefix_cache_queries"])
        for name, doc, field in KV_COUNTERS:
            yield self._counter(name, doc, values[field])

    def _grammar_cache(self, stats: SchedulerStats) -> Iterator[Metric]:
        """vLLM's structured-output grammar cache counters, as the core counts them; what a
        peer sends is checked: at most MAX_COUNT, hits at most the queries."""
        queries = min(stats.structured_output_cache_queries, MAX_COUNT)
        yield self._counter(
            "vllm:structured_output_cache_queries",
            "Structured output grammar cache queries, in terms of number of requests that "
            "looked up a compiled grammar.",
            queries,
        )
        yield self._counter(
            "vllm:structured_output_cache_hits",
            "Structured output grammar cache hits, in terms of number of requests whose "
            "grammar was already compiled.",
            min(stats.structured_output_cache_hits, queries),
        )

    def _spec_decode(self, stats: SchedulerStats) -> Iterator[Metric]:
        """vLLM's SpecDecodingProm counters; only when the engine speculates (a per-position
        entry per draft position), as vLLM registers them only with a speculative config."""
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        if not per_pos:
            return
        yield self._counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
            stats.spec_decode_num_drafts,
        )  # fmt: skip
        yield self._counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
            stats.spec_decode_num_draft_tokens,
        )  # fmt: skip
        yield self._counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
            stats.spec_decode_num_accepted_tokens,
        )  # fmt: skip
        family = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )
        for position, value in enumerate(per_pos):
            family.add_metric([*self.values, str(position)], value)
        yield family

    def _iteration_tokens(self) -> Iterator[Metric]:
        hist = self.snapshot.iteration_tokens
        if hist is None:
            return
        family = HistogramMetricFamily(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels=LABELS,
        )
        bounds = [*(_bound(b) for b in hist.upper_bounds), "+Inf"]
        buckets = list(zip(bounds, (float(c) for c in hist.cumulative_counts), strict=True))
        family.add_metric(self.values, buckets, hist.sum)
        yield family


LORA_INFO_LABELS = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]


def lora_requests_info(stats: SchedulerStats, num_slots: int) -> GaugeMetricFamily:
    """vLLM's vllm:lora_requests_info (only with --enable-lora): the engine's adapter slots
    (label `max_lora`, vLLM's name) and the adapters of the running and of the waiting requests,
    comma-separated, as labels, and the time as the value (a consumer such as llm-d's
    LoRA-affinity scorer takes the newest series)."""
    family = GaugeMetricFamily(
        "vllm:lora_requests_info", "Running stats on lora requests.", labels=LORA_INFO_LABELS
    )
    labels = [
        str(num_slots),
        ",".join(stats.waiting_lora_adapters),
        ",".join(stats.running_lora_adapters),
    ]
    family.add_metric(labels, time.time())
    return family


def _bound(value: float) -> str:
    return str(int(value)) + ".0" if value.is_integer() else str(value)


class EngineView:
    """Renders the engine series for the serving port's /metrics."""

    def __init__(
        self,
        fetch: Callable[[float], Awaitable[EngineSnapshot]],
        latest: Callable[[], SchedulerStats],
        model_name: str,
        info: EngineInfo,
    ) -> None:
        self.fetch, self.latest = fetch, latest
        self.model_name, self.info = model_name, info

    async def snapshot(self) -> EngineSnapshot:
        try:
            return await self.fetch(SNAPSHOT_TIMEOUT_S)
        except (TimeoutError, grpc.RpcError) as err:
            logger.debug("engine stats for /metrics from the latest outputs: %s", err)
            return EngineSnapshot(self.latest())

    async def render(self) -> bytes:
        """The series in the classic text format."""
        registry = CollectorRegistry()
        registry.register(EngineSeries(await self.snapshot(), self.model_name, self.info))
        return generate_latest(registry)
