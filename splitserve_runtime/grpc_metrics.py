"""The standard gRPC server and client metrics (grpc.aio and sync): the names, labels and
buckets of go-grpc-prometheus (and of Python's py-grpc-prometheus, which copies them), so stock
gRPC dashboards and alerts work: grpc_{server,client}_started_total,
grpc_{server,client}_handled_total{grpc_code} and the grpc_{server,client}_handling_seconds
histograms, labelled grpc_type, grpc_service and grpc_method.

Why not that library itself: py-grpc-prometheus 0.8.0 (sync) never counts a server-streaming call
as handled nor times it, its aio forks (py-async-grpc-prometheus 0.2.0, grpc-prometheus-metrics
0.0.5) break handlers that stream through `context.write()` and miss cancelled calls (asyncio's
CancelledError), and OpenTelemetry's grpc instrumentation records no metrics. On the client side
the same libraries count no streaming call as handled (py-grpc-prometheus' client interceptor
counts a unary call's code before it completes; the aio fork never counts a bidi stream started
and wraps every message of every stream), and any grpc.aio client interceptor puts a stream's
`write()`s behind an extra queue and task. Every RPC here streams one way or both, and the
core's step stream to the workers is the hot path, so the wrappers stay ours: they count each
call once when it starts and once when it ends, with its status (CANCELLED when the client went
away, UNAVAILABLE when the peer died), time it from start to end, and do nothing per message.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

Behavior = Callable[..., Any]
Recorder = Callable[[str], None]
"""Counts a call's end with its status code's name."""
Starter = Callable[[], Recorder]
GRPC_TYPES = {
    "unary_unary": "unary",
    "unary_stream": "server_stream",
    "stream_unary": "client_stream",
    "stream_stream": "bidi_stream",
}
"""Handler kind -> go-grpc-prometheus's grpc_type label."""
UNARY_KINDS = ("unary_unary", "stream_unary")
STREAM_KINDS = ("unary_stream", "stream_stream")
LABELS = ["grpc_type", "grpc_service", "grpc_method"]
HANDLING_HELP = {
    "server": "Histogram of response latency (seconds) of gRPC that had been application-level "
    "handled by the server.",
    "client": "Histogram of response latency (seconds) of the gRPC until it is finished by the "
    "application.",
}
"""go-grpc-prometheus's help texts."""


class RpcCounters:
    """grpc_{side}_started_total, grpc_{side}_handled_total, grpc_{side}_handling_seconds, for
    `side` "server" or "client"."""

    def __init__(self, registry: CollectorRegistry, side: str) -> None:
        self.started = Counter(
            f"grpc_{side}_started",
            f"Total number of RPCs started on the {side}.",
            LABELS,
            registry=registry,
        )
        self.handled = Counter(
            f"grpc_{side}_handled",
            f"Total number of RPCs completed on the {side}, regardless of success or failure.",
            [*LABELS, "grpc_code"],
            registry=registry,
        )
        self.handling = Histogram(
            f"grpc_{side}_handling_seconds",
            HANDLING_HELP[side],
            LABELS,
            registry=registry,
        )

    def starter(self, full_method: str, kind: str) -> Starter:
        """What a call of this method runs first: counts it started and returns the function
        that counts (with its status code's name) and times its end."""
        service, _, method = full_method.lstrip("/").partition("/")
        labels = (GRPC_TYPES[kind], service, method)
        started_count = self.started.labels(*labels)
        handling = self.handling.labels(*labels)

        def start() -> Recorder:
            started_count.inc()
            started = time.perf_counter()

            def record(code: str) -> None:
                self.handled.labels(*labels, code).inc()
                handling.observe(time.perf_counter() - started)

            return record

        return start

    def wrap(
        self,
        handler: Any,
        full_method: str,
        unary: Callable[[Behavior, Starter], Behavior],
        stream: Callable[[Behavior, Starter], Behavior],
    ) -> Any:
        for kind, wrapper in [
            *((k, unary) for k in UNARY_KINDS),
            *((k, stream) for k in STREAM_KINDS),
        ]:
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(
                    **{kind: wrapper(behavior, self.starter(full_method, kind))}
                )
        return handler


def _code_name(context: Any, exc: BaseException | None) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if exc is None:
        return "OK"
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    return "UNKNOWN"


class GrpcServerMetrics(grpc.aio.ServerInterceptor):
    """For grpc.aio servers."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counters = RpcCounters(registry, "server")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return self.counters.wrap(
            handler, handler_call_details.method, _wrap_async_unary, _wrap_async_stream
        )


class SyncGrpcServerMetrics(grpc.ServerInterceptor):
    """For synchronous grpc servers."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counters = RpcCounters(registry, "server")

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        return self.counters.wrap(
            handler, handler_call_details.method, _wrap_sync_unary, _wrap_sync_stream
        )


def _wrap_async_unary(behavior: Behavior, start: Starter) -> Behavior:
    async def wrapper(request: Any, context: Any) -> Any:
        record = start()
        try:
            result = await behavior(request, context)
        except BaseException as exc:
            record(_code_name(context, exc))
            raise
        record(_code_name(context, None))
        return result

    return wrapper


def _wrap_async_stream(behavior: Behavior, start: Starter) -> Behavior:
    if not inspect.isasyncgenfunction(behavior):  # streams through context.write()
        return _wrap_async_unary(behavior, start)

    async def wrapper(request: Any, context: Any) -> AsyncIterator[Any]:
        record = start()
        try:
            async for item in behavior(request, context):
                yield item
        except BaseException as exc:
            record(_code_name(context, exc))
            raise
        record(_code_name(context, None))

    return wrapper


def _wrap_sync_unary(behavior: Behavior, start: Starter) -> Behavior:
    def wrapper(request: Any, context: Any) -> Any:
        record = start()
        try:
            result = behavior(request, context)
        except BaseException as exc:
            record(_code_name(context, exc))
            raise
        record(_code_name(context, None))
        return result

    return wrapper


def _wrap_sync_stream(behavior: Behavior, start: Starter) -> Behavior:
    def wrapper(request: Any, context: Any) -> Iterator[Any]:
        record = start()
        try:
            yield from behavior(request, context)
        except BaseException as exc:
            record(_code_name(context, exc))
            raise
        record(_code_name(context, None))

    return wrapper
