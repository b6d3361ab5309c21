"""The frontend's spans of a request (--otlp-traces-endpoint), with vLLM's names and attributes.

Each engine request (each of a call's n completions) gets vLLM's `llm_request` span (kind
SERVER, the gen_ai.* attributes of vLLM's output processor), from the call's arrival to its end,
under the caller's `traceparent` (HTTP header or gRPC metadata) when it sent one. Under it:
`tokenize` (arrival until the request went to the engine: parsing, validation, the tokenizer's
queue and its work) and `detokenize` (the first output from the engine core until the last:
detokenizing, stop strings, the deltas to the client). The context of `llm_request` travels to
the engine core with the request (EngineCoreRequest.trace_context), whose spans hang under it;
a request resubmitted to a restarted core keeps it.

The ingress (OpenAI HTTP routes, GenerationService, VllmEngine) puts the caller's context in
CALLER_TRACE before the engine sees the request; spans are built on the event loop only when a
request starts and ends (never per token).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from frontend_svc.metrics import RequestStats
from frontend_svc.requests import EngineRequest
from splitserve_contracts.output_types import FinishReason
from splitserve_contracts.sampling_types import SamplingParams
from splitserve_runtime.tracing import TraceContext, Tracing, context_of, from_headers, wall_ns

logger = logging.getLogger(__name__)
CALLER_TRACE: ContextVar[TraceContext | None] = ContextVar("caller_trace", default=None)
"""The trace context the client sent with the call being served (this task's)."""
_state = {"is_tracing": False, "has_warned": False}


def accept_caller_traces() -> None:
    """This process traces (--otlp-traces-endpoint): take the clients' trace contexts."""
    _state["is_tracing"] = True


def set_caller_trace(headers: Mapping[str, str]) -> None:
    """The ingress: remember the client's context for the engine (vLLM warns once when a
    client sends one and tracing is off)."""
    caller = from_headers(headers)
    if caller is not None and not _state["is_tracing"] and not _state["has_warned"]:
        _state["has_warned"] = True
        logger.warning("Received a request with trace context but tracing is disabled")
    CALLER_TRACE.set(caller if _state["is_tracing"] else None)


class TracedRequest(Protocol):
    """What the frontend keeps of a request that its spans read (output_processor's
    RequestState)."""

    span: Any
    stats: RequestStats
    params: SamplingParams
    request: EngineRequest | None
    num_prompt_tokens: int
    num_output_tokens: int
    first_output_at: float | None


class RequestTracer:
    """Starts and ends the frontend's spans of each engine request."""

    def __init__(self, tracing: Tracing, model_name: str) -> None:
        self.tracer = tracing.tracer
        self.model_name = model_name

    def start(
        self, request: EngineRequest, arrival: float, with_tokenize: bool
    ) -> tuple[trace.Span, TraceContext]:
        """The request's llm_request span (started at `arrival`, time.monotonic()) and the
        context the engine core gets; `with_tokenize` adds the tokenize span (once per call)."""
        caller = CALLER_TRACE.get()
        parent = caller.parent() if caller is not None else None
        span = self.tracer.start_span(
            "llm_request", context=parent, kind=SpanKind.SERVER, start_time=wall_ns(arrival)
        )
        if with_tokenize:
            child = self.tracer.start_span(
                "tokenize",
                context=trace.set_span_in_context(span),
                start_time=wall_ns(arrival),
                attributes={"gen_ai.usage.prompt_tokens": len(request.prompt_token_ids)},
            )
            child.end()
        return span, context_of(span)

    def finish(self, state: TracedRequest, reason: FinishReason) -> None:
        """End the request's spans with vLLM's attributes (its timings as the metrics take
        them: the frontend's clock for TTFT and E2E, the core's for the rest)."""
        span: Any = state.span
        now = time.monotonic()
        stats, params = state.stats, state.params
        if state.first_output_at is not None:
            detok = self.tracer.start_span(
                "detokenize",
                context=trace.set_span_in_context(span),
                start_time=wall_ns(state.first_output_at),
                attributes={"gen_ai.usage.completion_tokens": state.num_output_tokens},
            )
            detok.end()
        attributes: dict[str, Any] = {
            "gen_ai.request.id": state.request.request_id if state.request else "",
            "gen_ai.response.model": self.model_name,
            "gen_ai.usage.prompt_tokens": state.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": state.num_output_tokens,
            "gen_ai.latency.e2e": now - stats.arrival,
            "gen_ai.response.finish_reasons": [str(reason)],
            "gen_ai.request.n": 1,
        }
        if state.first_output_at is not None:
            attributes["gen_ai.latency.time_to_first_token"] = state.first_output_at - stats.arrival
        _core_latencies(attributes, stats)
        for name, value in (("top_p", params.top_p), ("temperature", params.temperature),
                            ("max_tokens", params.max_tokens)):  # fmt: skip
            if value is not None:
                attributes[f"gen_ai.request.{name}"] = value
        span.set_attributes(attributes)
        span.end()


def _core_latencies(attributes: dict[str, Any], stats: RequestStats) -> None:
    """vLLM's queue, prefill, decode and inference times, from the core's timestamps."""
    queued, scheduled = stats.queued_ts, stats.scheduled_ts
    first, last = stats.first_token_ts, stats.last_token_ts
    if queued is not None and scheduled is not None:
        attributes["gen_ai.latency.time_in_queue"] = max(0.0, scheduled - queued)
    if scheduled is None or first is None or last is None:
        return
    attributes["gen_ai.latency.time_in_model_prefill"] = max(0.0, first - scheduled)
    attributes["gen_ai.latency.time_in_model_decode"] = last - first
    attributes["gen_ai.latency.time_in_model_inference"] = max(0.0, last - scheduled)
