"""OpenTelemetry tracing shared by the three services (vLLM's --otlp-traces-endpoint).

Each service that is given an endpoint exports its spans over OTLP/gRPC through the SDK's
BatchSpanProcessor (a background thread: nothing on a serving thread waits for the network).
Spans of one request form one trace across the services: the W3C trace context travels with
the request itself (`TraceContext` on EngineCoreRequest and NewRequestData), since one gRPC
stream carries every request between two services.

The engine core and the workers never build spans on their hot threads: they record timestamps
on the request (cheap) and hand finished requests to a `SpanEmitter`, whose thread builds the
spans with those timestamps. A span whose id was promised earlier (the core tells the workers
its request span's id when the request is first scheduled, long before that span is built)
gets that id through `PresetIds`.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from splitserve_runtime.flags import Flag, flag

logger = logging.getLogger(__name__)
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
MAX_TRACESTATE_CHARS = 512
DETAIL_MODULES = ("model", "worker", "all")
_PROPAGATOR = TraceContextTextMapPropagator()


def _endpoint(text: str) -> str:
    if text and not re.match(r"^(https?://)?[\w.\-\[\]:]+(:\d+)?/?$", text):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT or http(s)://HOST:PORT, got {text!r}")
    return text


TRACING_FLAGS: tuple[Flag, ...] = (
    flag(
        "--otlp-traces-endpoint",
        type=_endpoint,
        default="",
        help="send OpenTelemetry spans of every request to this OTLP/gRPC collector (vLLM's "
        "flag), e.g. http://otel-collector:4317; a client's `traceparent` header (HTTP) or "
        "metadata (gRPC) becomes the parent (default: no tracing)",
    ),
    flag(
        "--collect-detailed-traces",
        nargs="+",
        choices=DETAIL_MODULES,
        default=[],
        help="vLLM's flag: model, worker or all add the workers' model time (forward and whole "
        "step, summed over the steps a request was in) to their spans (default: step counts "
        "and timestamps only)",
    ),
)
"""--otlp-traces-endpoint and --collect-detailed-traces (every service)."""


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A W3C trace context as it travels with a request (vLLM's trace_headers)."""

    traceparent: str
    tracestate: str = ""

    @property
    def trace_id(self) -> int:
        return int(self.traceparent[3:35], 16)

    @property
    def span_id(self) -> int:
        return int(self.traceparent[36:52], 16)

    @property
    def is_sampled(self) -> bool:
        return bool(int(self.traceparent[53:55], 16) & 1)

    def child(self, span_id: int) -> TraceContext:
        """The context a span with id `span_id` under this one hands on."""
        return TraceContext(f"{self.traceparent[:36]}{span_id:016x}{self.traceparent[52:]}",
                            self.tracestate)  # fmt: skip

    def parent(self) -> Context:
        """The OpenTelemetry context whose span is this one (remote)."""
        carrier = {"traceparent": self.traceparent}
        if self.tracestate:
            carrier["tracestate"] = self.tracestate
        return _PROPAGATOR.extract(carrier)


def trace_context(traceparent: str, tracestate: str = "") -> TraceContext | None:
    """A TraceContext from the two W3C values; None when traceparent is empty. ValueError,
    saying what is wrong, for a malformed one (every hop validates what it receives)."""
    if not traceparent:
        return None
    if not TRACEPARENT.match(traceparent) or traceparent[3:35] == "0" * 32:
        raise ValueError("traceparent must be 00-<32 hex trace id>-<16 hex span id>-<2 hex flags>")
    if traceparent[36:52] == "0" * 16:
        raise ValueError("traceparent's span id must not be zero")
    if len(tracestate) > MAX_TRACESTATE_CHARS or not tracestate.isprintable():
        raise ValueError(f"tracestate must be printable and at most {MAX_TRACESTATE_CHARS} chars")
    return TraceContext(traceparent, tracestate)


def from_headers(headers: Mapping[str, str]) -> TraceContext | None:
    """The caller's trace context (HTTP headers or gRPC metadata); a malformed one is ignored,
    as W3C asks of a receiver (a new trace starts)."""
    try:
        return trace_context(headers.get("traceparent", ""), headers.get("tracestate", ""))
    except ValueError:
        return None


def context_of(span: trace.Span) -> TraceContext:
    """The context `span` hands on to the next hop."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return TraceContext(carrier["traceparent"], carrier.get("tracestate", ""))


class PresetIds(RandomIdGenerator):
    """Random ids, except that the thread that set `next_span_id` gets that id for its next
    span (a span whose id another service already knows)."""

    def __init__(self) -> None:
        self._preset = threading.local()

    def use_next(self, span_id: int) -> None:
        self._preset.span_id = span_id

    def generate_span_id(self) -> int:
        span_id = getattr(self._preset, "span_id", 0)
        if span_id:
            self._preset.span_id = 0
            return int(span_id)
        return super().generate_span_id()


@dataclass(frozen=True)
class Tracing:
    """A service's tracer and what it needs to build spans with preset ids."""

    tracer: trace.Tracer
    provider: TracerProvider
    ids: PresetIds
    detailed: bool = False
    """--collect-detailed-traces asked for model time."""

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what the batch processor still holds


def start_tracing(
    service: str, endpoint: str, detailed: tuple[str, ...] | list[str] = ()
) -> Tracing | None:
    """The service's tracer exporting to `endpoint` over OTLP/gRPC; None when no endpoint."""
    if not endpoint:
        return None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol != "grpc":
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol}: only grpc is available")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    ids = PresetIds()
    resource = Resource.create(
        {"service.name": f"splitserve-{service}", "vllm.process_id": str(os.getpid())}
    )
    provider = TracerProvider(resource=resource, id_generator=ids)
    insecure = not endpoint.startswith("https://")
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint, insecure=insecure)))
    logger.info("tracing: spans go to %s (OTLP/gRPC)", endpoint)
    return Tracing(provider.get_tracer(f"splitserve.{service}"), provider, ids, bool(detailed))


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading of this process as wall-clock nanoseconds (span times)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class SpanEmitter:
    """A thread that turns records of finished work into spans (`build(tracing, record)`), so
    the thread that made the record only puts it in a queue."""

    def __init__(self, tracing: Tracing, build: Callable[[Tracing, Any], None]) -> None:
        self.tracing = tracing
        self._build = build
        self._records: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="span-emitter", daemon=True).start()

    def submit(self, record: Any) -> None:
        self._records.put(record)

    def _run(self) -> None:
        while True:
            record = self._records.get()
            try:
                self._build(self.tracing, record)
            except Exception:  # a bad record must not stop tracing
                logger.exception("building a span failed")
