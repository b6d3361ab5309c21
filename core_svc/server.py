"""EngineCoreService servicer: handlers only convert and enqueue; the busy loop does the work.

Each EngineStream gets a client id. The busy-loop thread hands a client's outputs to
`output_sink`, which moves them onto that stream's asyncio queue without blocking the loop; the
stream's handler converts and sends them. A stream that ends (or whose peer vanishes) aborts
every request it added.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import cast

import grpc

from core_svc import convert
from core_svc.engine_loop import EngineCoreProc
from core_svc.metrics import CoreMetrics
from core_svc.outputs import EngineCoreOutputs
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc

logger = logging.getLogger(__name__)
_STREAM_CLOSED = object()


class EngineCoreServicer(core_grpc.EngineCoreServiceServicer):
    """Handshake, EngineStream and GetSchedulerStats over one EngineCoreProc."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: CoreMetrics | None = None) -> None:
        self._loop = loop
        self._metrics = metrics
        self._client_ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[object]] = {}
        self._proc: EngineCoreProc | None = None
        self._info: core_pb2.EngineInfo | None = None

    def set_metrics(self, metrics: CoreMetrics) -> None:
        self._metrics = metrics

    def attach(self, proc: EngineCoreProc, info: core_pb2.EngineInfo) -> None:
        """Start serving streams (the engine is up)."""
        self._proc, self._info = proc, info

    async def close_streams(self) -> None:
        """End every EngineStream (shutdown): their requests are aborted."""
        for queue in list(self._queues.values()):
            queue.put_nowait(_STREAM_CLOSED)

    @property
    def num_streams(self) -> int:
        return len(self._queues)

    def output_sink(self, client_id: int, outputs: EngineCoreOutputs) -> None:
        """Called on the busy-loop thread: hand outputs to the client's stream, never block."""
        queue = self._queues.get(client_id)
        if queue is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, (outputs, time.perf_counter()))

    async def _require(
        self, context: grpc.aio.ServicerContext
    ) -> tuple[EngineCoreProc, core_pb2.EngineInfo]:
        if self._proc is None or self._info is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the engine core is still starting (loading the model on the "
                "workers); retry shortly",
            )
        assert self._proc is not None and self._info is not None
        return self._proc, self._info

    async def Handshake(  # noqa: N802 (gRPC method name)
        self, request: core_pb2.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> core_pb2.HandshakeResponse:
        _, info = await self._require(context)
        logger.info("handshake from %s", request.client_name or context.peer())
        return core_pb2.HandshakeResponse(engine_info=info)

    async def GetSchedulerStats(  # noqa: N802
        self, request: core_pb2.GetSchedulerStatsRequest, context: grpc.aio.ServicerContext
    ) -> core_pb2.GetSchedulerStatsResponse:
        proc, _ = await self._require(context)
        stats = convert.scheduler_stats_to_proto(proc.latest_stats)
        return core_pb2.GetSchedulerStatsResponse(scheduler_stats=stats)

    async def EngineStream(  # noqa: N802
        self,
        request_iterator: AsyncIterator[core_pb2.EngineStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[core_pb2.EngineStreamResponse]:
        proc, _ = await self._require(context)
        client_id = next(self._client_ids)
        queue: asyncio.Queue[object] = asyncio.Queue()
        self._queues[client_id] = queue
        if self._metrics is not None:
            self._metrics.streams.set(len(self._queues))
        reader = asyncio.create_task(self._read(client_id, proc, request_iterator, queue))
        logger.info("stream %d opened by %s", client_id, context.peer())
        try:
            while True:
                item = await queue.get()
                if item is _STREAM_CLOSED:
                    return
                if isinstance(item, core_pb2.EngineStreamResponse):  # a pong
                    yield item
                    continue
                outputs, handed_at = cast(tuple[EngineCoreOutputs, float], item)
                yield core_pb2.EngineStreamResponse(
                    outputs=convert.engine_core_outputs_to_proto(outputs)
                )
                if self._metrics is not None:
                    self._metrics.output_send_seconds.observe(time.perf_counter() - handed_at)
        finally:
            self._queues.pop(client_id, None)
            if self._metrics is not None:
                self._metrics.streams.set(len(self._queues))
            proc.close_client(client_id)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            logger.info("stream %d closed; its requests were aborted", client_id)

    async def _read(
        self,
        client_id: int,
        proc: EngineCoreProc,
        request_iterator: AsyncIterator[core_pb2.EngineStreamRequest],
        queue: asyncio.Queue[object],
    ) -> None:
        """Move the client's adds and aborts, in order, onto the engine's input queue."""
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("payload")
                if kind == "add":
                    now = time.monotonic()
                    proc.add_requests(
                        client_id,
                        [convert.request_from_proto(r, client_id, now) for r in msg.add.requests],
                    )
                elif kind == "abort":
                    proc.abort_requests(client_id, list(msg.abort.request_handles))
                elif kind == "ping":
                    queue.put_nowait(
                        core_pb2.EngineStreamResponse(pong=core_pb2.Pong(ping_id=msg.ping.ping_id))
                    )
        except grpc.RpcError:
            pass
        finally:
            queue.put_nowait(_STREAM_CLOSED)
