"""A grpc.aio server interceptor counting RPCs by service, method and status code."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

Behavior = Callable[..., Any]


class GrpcServerMetrics(grpc.aio.ServerInterceptor):
    """`splitserve_grpc_server_started_total` and `splitserve_grpc_server_handled_total`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_service", "grpc_method"]
        self.started = Counter("splitserve_grpc_server_started", "RPCs started on this server.",
                               labels, registry=registry)
        self.handled = Counter("splitserve_grpc_server_handled",
                               "RPCs completed on this server, by status code.",
                               [*labels, "grpc_code"], registry=registry)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        record = self._recorder(service, method)
        for kind in ("unary_unary", "stream_unary"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(**{kind: _wrap_unary(behavior, record)})
        for kind in ("unary_stream", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(**{kind: _wrap_stream(behavior, record)})
        return handler

    def _recorder(self, service: str, method: str) -> Callable[[Any, BaseException | None], None]:
        self.started.labels(service, method).inc()

        def record(context: Any, exc: BaseException | None) -> None:
            self.handled.labels(service, method, _code_name(context, exc)).inc()
        return record


def _code_name(context: Any, exc: BaseException | None) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if exc is None:
        return "OK"
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    return "UNKNOWN"


def _wrap_unary(behavior: Behavior, record: Callable[[Any, BaseException | None], None]) -> Behavior:
    async def wrapper(request: Any, context: Any) -> Any:
        try:
            result = await behavior(request, context)
        except BaseException as exc:
            record(context, exc)
            raise
        record(context, None)
        return result
    return wrapper


def _wrap_stream(behavior: Behavior, record: Callable[[Any, BaseException | None], None]) -> Behavior:
    async def wrapper(request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            async for item in behavior(request, context):
                yield item
        except BaseException as exc:
            record(context, exc)
            raise
        record(context, None)
    return wrapper
