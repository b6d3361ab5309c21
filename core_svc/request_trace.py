"""What the engine core's busy loop records of a traced request (--otlp-traces-endpoint): the
frontend span it belongs under, the id its own span will have (the workers hang their spans
under it before it exists), and the scheduler's events with their times. Cheap to keep: a few
appends per request, never per token; core_svc/tracing.py builds the spans off the loop."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from splitserve_contracts.output_types import EngineCoreEventType
from splitserve_runtime.tracing import TraceContext, trace_context


@dataclass(slots=True)
class RequestTrace:
    """A traced request's context and timeline (time.monotonic() seconds)."""

    parent: TraceContext
    """The frontend's llm_request span."""
    span_id: int = field(default_factory=lambda: random.getrandbits(64) or 1)
    """The id of this core's span of the request."""
    events: list[tuple[EngineCoreEventType, float]] = field(default_factory=list)
    num_recoveries: int = 0
    """Times its worker ranks were lost and it was sent again to new ones."""
    finished_at: float = 0.0

    @property
    def for_workers(self) -> TraceContext:
        """The context the worker ranks' spans hang under: this core's span."""
        return self.parent.child(self.span_id)


def request_trace(traceparent: str, tracestate: str) -> RequestTrace | None:
    """The trace of a request a frontend sent with this context; None when there is none, it
    is not sampled, or it is malformed (ignored, as W3C asks of a receiver)."""
    try:
        context = trace_context(traceparent, tracestate)
    except ValueError:
        return None
    return RequestTrace(context) if context is not None and context.is_sampled else None
