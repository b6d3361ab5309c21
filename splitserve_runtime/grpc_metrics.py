"""Server interceptors counting RPCs by service, method and status code (grpc.aio and sync)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

Behavior = Callable[..., Any]
Recorder = Callable[[Any, BaseException | None], None]
UNARY_KINDS = ("unary_unary", "stream_unary")
STREAM_KINDS = ("unary_stream", "stream_stream")


class RpcCounters:
    """`splitserve_grpc_server_started_total` and `splitserve_grpc_server_handled_total`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_service", "grpc_method"]
        self.started = Counter(
            "splitserve_grpc_server_started",
            "RPCs started on this server.",
            labels,
            registry=registry,
        )
        self.handled = Counter(
            "splitserve_grpc_server_handled",
            "RPCs completed on this server, by status code.",
            [*labels, "grpc_code"],
            registry=registry,
        )

    def recorder(self, full_method: str) -> Recorder:
        """Count a started RPC; the returned function counts its completion."""
        service, _, method = full_method.lstrip("/").partition("/")
        self.started.labels(service, method).inc()

        def record(context: Any, exc: BaseException | None) -> None:
            self.handled.labels(service, method, _code_name(context, exc)).inc()

        return record

    def wrap(
        self,
        handler: Any,
        full_method: str,
        unary: Callable[[Behavior, Recorder], Behavior],
        stream: Callable[[Behavior, Recorder], Behavior],
    ) -> Any:
        record = self.recorder(full_method)
        for kind, wrapper in [
            *((k, unary) for k in UNARY_KINDS),
            *((k, stream) for k in STREAM_KINDS),
        ]:
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(**{kind: wrapper(behavior, record)})
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
        self.counters = RpcCounters(registry)

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
        self.counters = RpcCounters(registry)

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


def _wrap_async_unary(behavior: Behavior, record: Recorder) -> Behavior:
    async def wrapper(request: Any, context: Any) -> Any:
        try:
            result = await behavior(request, context)
        except BaseException as exc:
            record(context, exc)
            raise
        record(context, None)
        return result

    return wrapper


def _wrap_async_stream(behavior: Behavior, record: Recorder) -> Behavior:
    if not inspect.isasyncgenfunction(behavior):  # streams through context.write()
        return _wrap_async_unary(behavior, record)

    async def wrapper(request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            async for item in behavior(request, context):
                yield item
        except BaseException as exc:
            record(context, exc)
            raise
        record(context, None)

    return wrapper


def _wrap_sync_unary(behavior: Behavior, record: Recorder) -> Behavior:
    def wrapper(request: Any, context: Any) -> Any:
        try:
            result = behavior(request, context)
        except BaseException as exc:
            record(context, exc)
            raise
        record(context, None)
        return result

    return wrapper


def _wrap_sync_stream(behavior: Behavior, record: Recorder) -> Behavior:
    def wrapper(request: Any, context: Any) -> Iterator[Any]:
        try:
            yield from behavior(request, context)
        except BaseException as exc:
            record(context, exc)
            raise
        record(context, None)

    return wrapper
