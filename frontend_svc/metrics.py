"""Prometheus metrics of the frontend: vLLM's request metrics, plus the frontend<->core hop.

Every interval is taken inside one process's clock: TTFT and end-to-end latency on this
frontend's clock (arrival to first token / to finish); queue, prefill, decode, inference time and
inter-token latency from engine-core timestamps (events and step timestamps the core stamps),
which are only ever subtracted from each other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitserve_contracts.output_types import EngineCoreEvent, EngineCoreEventType, FinishReason

LABELS = ["model_name", "engine"]
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
N_BUCKETS = (1, 2, 5, 10, 20)
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


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


@dataclass(slots=True)
class RequestStats:
    """Timestamps of one engine request. `arrival`/`first_token` are frontend monotonic
    seconds; the `*_ts` fields are engine-core monotonic seconds."""

    arrival: float
    num_prompt_tokens: int
    queued_ts: float | None = None
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache (the core says with the first token)."""


@dataclass(frozen=True, slots=True)
class _MetricMaker:
    """Makes the frontend's metrics in `registry`, bound to the served model's labels."""

    registry: CollectorRegistry
    values: tuple[str, str]
    lengths: tuple[int, ...]
    """Token-count buckets up to the model's context length."""

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, LABELS, registry=self.registry).labels(*self.values)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        metric = Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)
        return metric.labels(*self.values)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, LABELS, registry=self.registry).labels(*self.values)


class FrontendMetrics:
    """Metric objects bound to the served model's labels."""

    def __init__(
        self, registry: CollectorRegistry, model_name: str, engine: str, max_model_len: int
    ) -> None:
        self._values = (model_name, engine)
        make = _MetricMaker(registry, self._values, buckets_1_2_5(max_model_len))
        # Made in this order: the exposition lists them so.
        self._add_token_metrics(make)
        self._add_request_metrics(make)
        self._add_latency_metrics(make)
        self._add_hop_metrics(make)

    def _add_token_metrics(self, make: _MetricMaker) -> None:
        """Tokens processed, and requests finished (by reason)."""
        self.prompt_tokens = make.counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.generation_tokens = make.counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.prompt_tokens_cached = make.counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.prefill_kv_computed = make.histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            make.lengths,
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=make.registry,
        )

    def _add_request_metrics(self, make: _MetricMaker) -> None:
        """Each request's sizes and parameters."""
        self.request_prompt_tokens = make.histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", make.lengths
        )
        self.request_generation_tokens = make.histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", make.lengths
        )
        self.params_n = make.histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self.params_max_tokens = make.histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            make.lengths,
        )
        self.max_num_generation_tokens = make.histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            make.lengths,
        )

    def _add_latency_metrics(self, make: _MetricMaker) -> None:
        """vLLM's request latencies: TTFT, ITL, TPOT, end to end, and the engine's phases."""
        self.ttft = make.histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = make.histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.tpot = make.histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = make.histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_BUCKETS,
        )
        self.queue_time = make.histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_BUCKETS,
        )
        self.inference_time = make.histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_BUCKETS,
        )
        self.prefill_time = make.histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_BUCKETS,
        )
        self.decode_time = make.histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_BUCKETS,
        )

    def _add_hop_metrics(self, make: _MetricMaker) -> None:
        """The frontend<->core hop and this frontend's own work (splitserve's)."""
        self.core_rtt = make.histogram(
            "splitserve_frontend_core_rtt_seconds",
            "Round trip of a ping over the frontend<->core EngineStream, on the frontend's clock.",
            HOP_BUCKETS,
        )
        self.output_processing = make.histogram(
            "splitserve_frontend_output_processing_seconds",
            "Per message from the core: time to detokenize, check stops and hand deltas to "
            "requests.",
            HOP_BUCKETS,
        )
        self.reconnects = make.counter(
            "splitserve_frontend_core_reconnects",
            "Times the stream to the engine core broke and was reopened.",
        )
        self.resubmitted = make.counter(
            "splitserve_frontend_requests_resubmitted",
            "Requests in flight resubmitted (prompt and the tokens so far) to an engine core "
            "that came back after the stream to it broke.",
        )
        self.in_flight = make.gauge(
            "splitserve_frontend_requests_in_flight",
            "Engine requests this frontend is streaming.",
        )

    def on_request(self, n: int, max_tokens: int) -> None:
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def on_parent_finished(self, max_num_generation_tokens: int) -> None:
        """Every one of a request's n completions finished; the longest had this many tokens."""
        self.max_num_generation_tokens.observe(max_num_generation_tokens)

    def on_output(
        self,
        stats: RequestStats,
        num_tokens: int,
        core_ts: float,
        events: list[EngineCoreEvent] | None,
    ) -> None:
        """One step's output for one request."""
        for event in events or ():
            if event.type == EngineCoreEventType.QUEUED and stats.queued_ts is None:
                stats.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED and stats.scheduled_ts is None:
                stats.scheduled_ts = event.timestamp
        if not num_tokens:
            return
        if stats.first_token_ts is None:
            stats.first_token_ts = core_ts
            self.ttft.observe(time.monotonic() - stats.arrival)
            self.prompt_tokens.inc(stats.num_prompt_tokens)
            self.prompt_tokens_cached.inc(stats.num_cached_tokens)
        elif stats.last_token_ts is not None:
            self.itl.observe(core_ts - stats.last_token_ts)
        stats.last_token_ts = core_ts
        stats.num_generation_tokens += num_tokens
        self.generation_tokens.inc(num_tokens)

    def on_finish(self, stats: RequestStats, reason: FinishReason) -> None:
        self.request_success.labels(*self._values, str(reason)).inc()
        self.e2e.observe(time.monotonic() - stats.arrival)
        self.request_prompt_tokens.observe(stats.num_prompt_tokens)
        self.request_generation_tokens.observe(stats.num_generation_tokens)
        if stats.first_token_ts is not None:  # its prompt was computed
            self.prefill_kv_computed.observe(stats.num_prompt_tokens - stats.num_cached_tokens)
        if stats.queued_ts is not None and stats.scheduled_ts is not None:
            self.queue_time.observe(max(0.0, stats.scheduled_ts - stats.queued_ts))
        first, last = stats.first_token_ts, stats.last_token_ts
        if first is None or last is None or stats.scheduled_ts is None:
            return
        self.prefill_time.observe(max(0.0, first - stats.scheduled_ts))
        self.decode_time.observe(last - first)
        self.inference_time.observe(max(0.0, last - stats.scheduled_ts))
        if stats.num_generation_tokens > 1:
            self.tpot.observe((last - first) / (stats.num_generation_tokens - 1))
