"""The engine core's spans of a request (--otlp-traces-endpoint), built off the busy loop.

The loop hands over each traced request once it is freed (finished, aborted or failed); this
module snapshots what the spans need (a few numbers and the timeline the scheduler recorded)
and a SpanEmitter thread builds them:

    core.request   (kind SERVER, under the frontend's llm_request; its id is the one the worker
    │               ranks were given with the request, so their spans hang under it)
    ├── core.waiting   arrival in the core until first scheduled (vLLM's time in queue)
    └── core.running   first scheduled until freed; events `preempted` and `scheduled` as the
                       scheduler recorded them

A request resumed on new worker ranks (a rank restarted) keeps its span and counts the recovery
(splitserve.num_recoveries); one resubmitted to a restarted engine core gets a new core.request
under the same llm_request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from core_svc.request import Request
from core_svc.request_trace import RequestTrace
from splitserve_contracts.output_types import EngineCoreEventType
from splitserve_runtime.tracing import SpanEmitter, Tracing, wall_ns


@dataclass(frozen=True, slots=True)
class CoreSpanRecord:
    """What the spans of one finished request need, taken on the loop thread."""

    trace: RequestTrace
    request_id: str
    arrival: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    status: str
    engine_id: str


class CoreTracer:
    """Hands finished traced requests to the span-building thread."""

    def __init__(self, tracing: Tracing, engine_id: str) -> None:
        self.engine_id = engine_id
        self._emitter = SpanEmitter(tracing, build_spans)

    def on_finished(self, requests: list[Request]) -> None:
        """The busy loop: snapshot and queue (no span is built here)."""
        for r in requests:
            assert r.trace is not None
            self._emitter.submit(
                CoreSpanRecord(
                    r.trace, r.request_id, r.arrival_time, r.num_prompt_tokens,
                    len(r.output_token_ids), max(r.num_cached_tokens, 0), r.num_preemptions,
                    r.status.name, self.engine_id,
                )
            )  # fmt: skip


def build_spans(tracing: Tracing, record: CoreSpanRecord) -> None:
    """The emitter thread: core.request and its children, with the recorded times."""
    tracer, timeline = tracing.tracer, record.trace
    end = wall_ns(timeline.finished_at)
    tracing.ids.use_next(timeline.span_id)  # the id the workers already hang under
    span = tracer.start_span(
        "core.request",
        context=timeline.parent.parent(),
        kind=SpanKind.SERVER,
        start_time=wall_ns(record.arrival),
        attributes=_attributes(record),
    )
    inside = trace.set_span_in_context(span)
    scheduled = [ts for kind, ts in timeline.events if kind == EngineCoreEventType.SCHEDULED]
    first = scheduled[0] if scheduled else None
    waiting = tracer.start_span("core.waiting", context=inside, start_time=wall_ns(record.arrival))
    waiting.end(end_time=wall_ns(first) if first is not None else end)
    if first is not None:
        running = tracer.start_span("core.running", context=inside, start_time=wall_ns(first))
        for kind, ts in timeline.events:
            if ts > first and kind != EngineCoreEventType.QUEUED:
                running.add_event(kind.name.lower(), timestamp=wall_ns(ts))
        running.end(end_time=end)
    span.end(end_time=end)


def _attributes(record: CoreSpanRecord) -> dict[str, Any]:
    timeline = record.trace
    scheduled = [ts for kind, ts in timeline.events if kind == EngineCoreEventType.SCHEDULED]
    attributes: dict[str, Any] = {
        "gen_ai.request.id": record.request_id,
        "gen_ai.usage.prompt_tokens": record.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": record.num_output_tokens,
        "splitserve.engine_id": record.engine_id,
        "splitserve.num_cached_tokens": record.num_cached_tokens,
        "splitserve.num_preemptions": record.num_preemptions,
        "splitserve.num_recoveries": timeline.num_recoveries,
        "splitserve.status": record.status,
    }
    if scheduled:
        attributes["gen_ai.latency.time_in_queue"] = max(0.0, scheduled[0] - record.arrival)
        attributes["gen_ai.latency.time_in_scheduler"] = timeline.finished_at - scheduled[0]
    return attributes
