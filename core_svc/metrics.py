"""Prometheus metrics of the engine core: vLLM's scheduler metrics, plus the core<->worker hop.

vLLM names, types, labels (`model_name`, `engine`) and buckets, so existing dashboards, alerts
and autoscalers work unchanged. Counters are declared without `_total`; the client adds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from core_svc.executor.abstract import FAULT_CAUSES
from core_svc.kv_connector.metrics import KvConnectorMetrics
from splitserve_contracts.output_types import SchedulerStats

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
HOP_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)
STEP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LABELS = ["model_name", "engine"]


class CoreMetrics:
    """Metric objects bound to this engine's labels."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        engine: str,
        cache_config: dict[str, str],
        num_speculative_tokens: int = 0,
    ) -> None:
        self._registry = registry
        self._values = (model_name, engine)
        self._add_scheduler_metrics()
        self.kv_connector = KvConnectorMetrics(registry, LABELS, self._values)
        self.spec_decode = (
            SpecDecodeMetrics(registry, self._values, num_speculative_tokens)
            if num_speculative_tokens
            else None
        )
        """vLLM's spec-decode counters, registered only with --speculative-config (as vLLM)."""
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the KV cache config.",
            sorted(cache_config),
            registry=registry,
        )
        info.labels(**cache_config).set(1)
        self._add_timing_metrics()
        self._add_recovery_metrics()
        self._last = SchedulerStats()

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, LABELS, registry=self._registry).labels(*self._values)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, LABELS, registry=self._registry).labels(*self._values)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        histogram = Histogram(name, doc, LABELS, buckets=buckets, registry=self._registry)
        return histogram.labels(*self._values)

    def _add_scheduler_metrics(self) -> None:
        """vLLM's scheduler metrics (fed by `observe_stats`)."""
        gauge, counter = self._gauge, self._counter
        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (here: a "
            "structured-output grammar still compiling). Sum of all reasons equals "
            "vllm:num_requests_waiting.",
            [*LABELS, "reason"],
            registry=self._registry,
        )
        self.waiting_capacity = by_reason.labels(*self._values, "capacity")
        self.waiting_deferred = by_reason.labels(*self._values, "deferred")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.kv_group_usage = Gauge(
            "splitserve:kv_cache_group_usage_perc",
            "Usage of each KV cache group (attention blocks; state slots of a model with state "
            "layers). vllm:kv_cache_usage_perc is the fuller group's. 1 means 100 percent.",
            [*LABELS, "kv_cache_group"],
            registry=self._registry,
        )
        self.attention_usage = self.kv_group_usage.labels(*self._values, "attention")
        self.state_usage = self.kv_group_usage.labels(*self._values, "state")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.encoder_queries = counter(
            "vllm:mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items (here: images "
            "looked up in the workers' encoder cache).",
        )
        self.encoder_hits = counter(
            "vllm:mm_cache_hits",
            "Multi-modal cache hits, in terms of number of cached items (here: images whose "
            "encoder output was already cached, so the encoder did not run).",
        )
        self._iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            LABELS,
            buckets=ITERATION_TOKEN_BUCKETS,
            registry=self._registry,
        )
        self.iteration_tokens = self._iteration_tokens.labels(*self._values)

    def _add_timing_metrics(self) -> None:
        """Where a step's time goes: the step, the worker round trip, the hops."""
        histogram = self._histogram
        self.step_seconds = histogram(
            "splitserve_core_step_seconds",
            "Engine step time (schedule, workers, update) on the core's clock: one "
            "observation per step whose output was applied (with async scheduling, the loop "
            "iteration that applied it).",
            STEP_BUCKETS,
        )
        self.worker_rtt_seconds = histogram(
            "splitserve_core_worker_rtt_seconds",
            "Per step: time from sending a SchedulerOutput to every rank to receiving the "
            "output rank's ModelRunnerOutput.",
            STEP_BUCKETS,
        )
        self.worker_hop_seconds = histogram(
            "splitserve_core_worker_hop_seconds",
            "Per step: the core<->worker round trip minus the worker's own step time "
            "(serialisation, gRPC and transport in both directions).",
            HOP_BUCKETS,
        )
        self.output_send_seconds = histogram(
            "splitserve_core_output_send_seconds",
            "Per message: time from the engine loop handing a frontend its step outputs to "
            "the message being written to that frontend's stream.",
            HOP_BUCKETS,
        )
        self.streams = self._gauge(
            "splitserve_core_frontend_streams", "Open frontend EngineStreams."
        )

    def _add_recovery_metrics(self) -> None:
        """Rank recoveries (core_svc/recovery.py)."""
        recoveries = Counter(
            "splitserve_engine_recoveries",
            "Times the engine lost its worker ranks and began bringing them up again, by cause "
            "(rank_died: a rank exited, broke its stream or failed a step; rank_hung: a step "
            "outlived its timeout).",
            [*LABELS, "cause"],
            registry=self._registry,
        )
        values = self._values
        self.recoveries = {cause: recoveries.labels(*values, cause) for cause in FAULT_CAUSES}
        self.recovery_seconds = self._histogram(
            "splitserve_engine_recovery_seconds",
            "Time from losing the worker ranks to stepping again on the ranks brought up anew.",
            RECOVERY_BUCKETS,
        )
        self.requests_resumed = self._counter(
            "splitserve_engine_requests_resumed",
            "Requests kept through a recovery and scheduled again on the new ranks.",
        )

    def observe_stats(self, stats: SchedulerStats, step_seconds: float | None) -> None:
        """Called after every loop iteration with the scheduler's cumulative snapshot."""
        last = self._last
        if step_seconds is not None:
            self.step_seconds.observe(step_seconds)
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs + stats.num_waiting_deferred)
        self.waiting_capacity.set(stats.num_waiting_reqs)
        self.waiting_deferred.set(stats.num_waiting_deferred)
        self.kv_usage.set(stats.kv_cache_usage)
        self.attention_usage.set(stats.num_used_blocks / max(1, stats.num_total_blocks))
        self.state_usage.set(stats.num_used_state_slots / max(1, stats.num_total_state_slots))
        if stats.prefix_cache_queries > last.prefix_cache_queries:
            self.prefix_queries.inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        if stats.prefix_cache_hits > last.prefix_cache_hits:
            self.prefix_hits.inc(stats.prefix_cache_hits - last.prefix_cache_hits)
        if stats.encoder_cache_queries > last.encoder_cache_queries:
            self.encoder_queries.inc(stats.encoder_cache_queries - last.encoder_cache_queries)
        if stats.encoder_cache_hits > last.encoder_cache_hits:
            self.encoder_hits.inc(stats.encoder_cache_hits - last.encoder_cache_hits)
        if stats.num_preemptions > last.num_preemptions:
            self.preemptions.inc(stats.num_preemptions - last.num_preemptions)
        if stats.step_id > last.step_id and stats.num_scheduled_tokens:
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
        if self.spec_decode is not None:
            self.spec_decode.observe(stats, last)
        self.kv_connector.observe(stats, last)
        self._last = stats

    def iteration_tokens_state(self) -> tuple[list[float], list[int], float]:
        """vllm:iteration_tokens_total as (upper bounds, cumulative counts with +Inf last,
        sum): what GetSchedulerStats hands the frontends for their serving port."""
        bounds = [float(b) for b in ITERATION_TOKEN_BUCKETS]
        counts: list[int] = []
        total = 0.0
        for family in self._iteration_tokens.collect():
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    counts.append(int(sample.value))
                elif sample.name.endswith("_sum"):
                    total = sample.value
        return bounds, counts, total

    def watch_structured_outputs(self, read: Callable[[], tuple[int, int]]) -> None:
        """vLLM's structured-output grammar cache counters, read at scrape time from `read`
        (cumulative (queries, hits) of the engine's StructuredOutputManager)."""
        self._registry.register(_GrammarCacheCollector(read, self._values))

    def observe_worker_step(self, rtt_seconds: float, worker_seconds: float) -> None:
        self.worker_rtt_seconds.observe(rtt_seconds)
        self.worker_hop_seconds.observe(max(0.0, rtt_seconds - worker_seconds))


class _GrammarCacheCollector(Collector):
    """vllm:structured_output_cache_{queries,hits}: the compile threads count, scrapes read."""

    def __init__(self, read: Callable[[], tuple[int, int]], values: tuple[str, str]) -> None:
        self._read = read
        self._values = list(values)

    def collect(self) -> Iterator[CounterMetricFamily]:
        queries, hits = self._read()
        for name, doc, value in (
            (
                "vllm:structured_output_cache_queries",
                "Structured output grammar cache queries, in terms of number of requests "
                "that looked up a compiled grammar.",
                queries,
            ),
            (
                "vllm:structured_output_cache_hits",
                "Structured output grammar cache hits, in terms of number of requests whose "
                "grammar was already compiled.",
                hits,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self._values, value)
            yield family


class SpecDecodeMetrics:
    """vLLM's SpecDecodingProm: drafts, draft tokens, accepted tokens and accepted tokens per
    draft position (label `position`), counters fed by the scheduler's cumulative stats."""

    def __init__(
        self, registry: CollectorRegistry, values: tuple[str, str], num_spec_tokens: int
    ) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=registry).labels(*values)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*LABELS, "position"],
            registry=registry,
        )
        self.num_accepted_per_pos = [
            per_pos.labels(*values, str(p)) for p in range(num_spec_tokens)
        ]

    def observe(self, stats: SchedulerStats, last: SchedulerStats) -> None:
        pairs = (
            (self.num_drafts, stats.spec_decode_num_drafts, last.spec_decode_num_drafts),
            (
                self.num_draft_tokens,
                stats.spec_decode_num_draft_tokens,
                last.spec_decode_num_draft_tokens,
            ),
            (
                self.num_accepted_tokens,
                stats.spec_decode_num_accepted_tokens,
                last.spec_decode_num_accepted_tokens,
            ),
        )
        for counter, now, before in pairs:
            if now > before:
                counter.inc(now - before)
        before_pos = last.spec_decode_num_accepted_tokens_per_pos
        for pos, (counter, now) in enumerate(
            zip(
                self.num_accepted_per_pos,
                stats.spec_decode_num_accepted_tokens_per_pos,
                strict=False,
            )
        ):
            previous = before_pos[pos] if pos < len(before_pos) else 0
            if now > previous:
                counter.inc(now - previous)
