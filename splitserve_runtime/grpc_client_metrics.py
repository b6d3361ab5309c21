"""The standard gRPC client metrics (grpc_client_started_total, grpc_client_handled_total,
grpc_client_handling_seconds; see splitserve_runtime.grpc_metrics for the names and why they are
ours) on the channels the services open to their peers.

Each call is counted when it starts and, through the call's done-callback, once when it ends with
its status; nothing runs per message. A sync channel gets a standard interceptor (it returns the
call itself, so a stream's messages pass untouched). A grpc.aio channel is wrapped instead:
grpc.aio's client interceptors put every `write()` of a stream through an extra queue and task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from splitserve_runtime.grpc_metrics import Recorder, RpcCounters, Starter


class GrpcClientMetrics:
    """The client counters of one service's registry, for every channel it opens."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counters = RpcCounters(registry, "client")
        self._starters: dict[tuple[str, str], Starter] = {}
        self._pending: set[asyncio.Future[None]] = set()

    def starter(self, full_method: str, kind: str) -> Starter:
        key = (full_method, kind)
        start = self._starters.get(key)
        if start is None:
            start = self._starters[key] = self.counters.starter(full_method, kind)
        return start

    def intercept(self, channel: grpc.Channel) -> grpc.Channel:
        """`channel` with the client metrics (a sync channel)."""
        return grpc.intercept_channel(channel, _SyncInterceptor(self))

    def wrap_aio(self, channel: grpc.aio.Channel) -> grpc.aio.Channel:
        """`channel` with the client metrics (a grpc.aio channel)."""
        return _MeteredAioChannel(channel, self)

    def record_aio_end(self, call: Any, record: Recorder) -> None:
        """A grpc.aio call ended (its done-callback): its code is read on the event loop."""
        try:
            future = asyncio.ensure_future(_record_code(call, record))
        except RuntimeError:  # the loop is closing: the process is going away
            return
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)


async def _record_code(call: Any, record: Recorder) -> None:
    code = await call.code()
    record(code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN")


def _sync_done(record: Recorder) -> Callable[[Any], None]:
    def done(call: Any) -> None:
        code = call.code()
        record(code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN")

    return done


class _SyncInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, metrics: GrpcClientMetrics) -> None:
        self.metrics = metrics

    def _call(self, kind: str, continuation: Any, details: Any, request: Any) -> Any:
        record = self.metrics.starter(details.method, kind)()
        call = continuation(details, request)
        call.add_done_callback(_sync_done(record))
        return call

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return self._call("unary_unary", continuation, details, request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return self._call("unary_stream", continuation, details, request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return self._call("stream_unary", continuation, details, requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return self._call("stream_stream", continuation, details, requests)


class _MeteredCallable:
    """A grpc.aio multi-callable that counts each call's start and end."""

    def __init__(self, inner: Any, start: Starter, metrics: GrpcClientMetrics) -> None:
        self._inner, self._start, self._metrics = inner, start, metrics

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        record = self._start()
        call = self._inner(*args, **kwargs)
        call.add_done_callback(lambda done: self._metrics.record_aio_end(done, record))
        return call


class _MeteredAioChannel(grpc.aio.Channel):
    """A grpc.aio channel whose calls are counted; everything else is the channel's own."""

    def __init__(self, channel: grpc.aio.Channel, metrics: GrpcClientMetrics) -> None:
        self._channel, self._metrics = channel, metrics

    def _metered(self, kind: str, inner: Any, method: str) -> Any:
        return _MeteredCallable(inner, self._metrics.starter(method, kind), self._metrics)

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        inner = self._channel.unary_unary(method, *args, **kwargs)
        return self._metered("unary_unary", inner, method)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        inner = self._channel.unary_stream(method, *args, **kwargs)
        return self._metered("unary_stream", inner, method)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        inner = self._channel.stream_unary(method, *args, **kwargs)
        return self._metered("stream_unary", inner, method)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        inner = self._channel.stream_stream(method, *args, **kwargs)
        return self._metered("stream_stream", inner, method)

    async def __aenter__(self) -> _MeteredAioChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._channel.close(None)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()
