"""The worker's span of each traced request (--otlp-traces-endpoint): not a span per step or per
token, one per request and rank process, summarising the steps it was in.

    worker.request   under the engine core's core.request (the context NewRequestData brought),
                     from the start of its first step here to the end of its last; attributes:
                     prefill steps and tokens, decode steps, and with --collect-detailed-traces
                     the model time vLLM reports (gen_ai.latency.time_in_model_forward /
                     time_in_model_execute: the steps' forward and whole-step times, summed)

Only the rank that answers the core (the output rank) records, on its step thread, a few
numbers per traced request per step; the span is built by a SpanEmitter thread when the request
is finished (finished_req_handles). A request resumed on a restarted rank gets a span from the
new process under the same core span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import SpanKind

from splitserve_contracts.output_types import StepTimings
from splitserve_runtime.tracing import SpanEmitter, TraceContext, Tracing, wall_ns
from worker_svc.scheduler_output import SchedulerOutput


@dataclass(slots=True)
class _Traced:
    """One traced request's steps on this rank (time.monotonic() seconds)."""

    context: TraceContext
    request_id: str
    rank: int
    first_start: float
    last_end: float = 0.0
    prefill_steps: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    forward_seconds: float = 0.0
    execute_seconds: float = 0.0


class StepTraces:
    """Per traced request, what its steps on this rank add up to."""

    def __init__(self, tracing: Tracing | None) -> None:
        self._emitter = SpanEmitter(tracing, build_span) if tracing is not None else None
        self._live: dict[int, _Traced] = {}

    def observe(
        self,
        step: SchedulerOutput,
        rank: int,
        started: float,
        ended: float,
        timings: StepTimings | None,
    ) -> None:
        """A step this rank answered (step thread): O(1) unless traced requests are in it."""
        if self._emitter is None:
            return
        for new in step.scheduled_new_reqs:
            if new.trace is not None:
                self._live[new.req_handle] = _Traced(new.trace, new.request_id, rank, started)
        if not self._live:
            return
        forward = timings.forward_seconds if timings is not None else 0.0
        handles = [r.req_handle for r in step.scheduled_new_reqs]
        handles += [int(h) for h in step.scheduled_cached_reqs.req_handles]
        for handle, num_tokens in zip(handles, step.num_scheduled_tokens.tolist(), strict=False):
            traced = self._live.get(handle)
            if traced is None:
                continue
            if num_tokens > 1:
                traced.prefill_steps += 1
                traced.prefill_tokens += num_tokens
            else:
                traced.decode_steps += 1
            traced.last_end = ended
            traced.forward_seconds += forward
            traced.execute_seconds += ended - started
        for handle in step.finished_req_handles.tolist():
            done = self._live.pop(int(handle), None)
            if done is not None:
                self._emitter.submit(done)


def build_span(tracing: Tracing, traced: _Traced) -> None:
    """The emitter thread: one worker.request span."""
    attributes: dict[str, Any] = {
        "gen_ai.request.id": traced.request_id,
        "splitserve.rank": traced.rank,
        "splitserve.prefill_steps": traced.prefill_steps,
        "splitserve.prefill_tokens": traced.prefill_tokens,
        "splitserve.decode_steps": traced.decode_steps,
    }
    if tracing.detailed:
        attributes["gen_ai.latency.time_in_model_forward"] = traced.forward_seconds
        attributes["gen_ai.latency.time_in_model_execute"] = traced.execute_seconds
    span = tracing.tracer.start_span(
        "worker.request",
        context=traced.context.parent(),
        kind=SpanKind.INTERNAL,
        start_time=wall_ns(traced.first_start),
        attributes=attributes,
    )
    span.end(end_time=wall_ns(traced.last_end or traced.first_start))
