"""EngineCoreService servicer: handlers only convert and enqueue; the busy loop does the work.

Each EngineStream gets a client id and an outbox in `ClientStreams`. The busy-loop thread hands
a client's outputs (and the KV-cache events it subscribed to) to `ClientStreams.deliver`, which
moves them onto that stream's asyncio queue without blocking the loop; the stream's handler
converts and sends them. A stream that ends (or whose peer vanishes) aborts every request it
added. A subscribed stream that falls behind stops getting KV-cache events until it has caught
up, then gets the whole cache again (a fresh snapshot): events never pile up in the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import cast

import grpc

from core_svc import convert
from core_svc.engine.engine_loop import EngineCoreProc
from core_svc.kv_cache.kv_events import KVEventBatch
from core_svc.lora import LORA_OFF, LoraError, LoraErrorKind
from core_svc.lora_admin import LoraAdmin
from core_svc.metrics import CoreMetrics
from core_svc.outputs import EngineCoreOutputs
from splitserve_contracts import output_convert
from splitserve_contracts.common.v1 import types_pb2 as common_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from splitserve_runtime.profiler_config import check_profile_prefix

logger = logging.getLogger(__name__)
_STREAM_CLOSED = object()


MAX_UNSENT_OUTPUTS = 10_000
"""A frontend that leaves this many step outputs unread is dropped: its requests are aborted
(their KV freed) and its stream ends; it reconnects when it reads again."""
MAX_UNSENT_BEFORE_KV_RESYNC = 1_000
"""A subscribed frontend with this many messages unsent loses its pending KV-cache events; once
its outbox is empty again it gets a fresh snapshot of the cache."""
RESET_PREFIX_CACHE_TIMEOUT_S = 30.0
LORA_STATUS = {
    LoraErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    LoraErrorKind.EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    LoraErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    LoraErrorKind.OFF: grpc.StatusCode.FAILED_PRECONDITION,
    LoraErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


class ClientStreams:
    """The outboxes of the open EngineStreams, by client id, on one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._client_ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[object]] = {}
        self.overflowed: set[int] = set()
        """Clients dropped for not reading; their handlers end at the next chance."""
        self.on_overflow: Callable[[int], None] = lambda client_id: None
        self._kv_lagging: dict[int, bool] = {}
        """Clients whose KV-cache events are being dropped -> whether a resync was asked."""

    def __len__(self) -> int:
        return len(self._queues)

    def open(self) -> tuple[int, asyncio.Queue[object]]:
        client_id = next(self._client_ids)
        queue: asyncio.Queue[object] = asyncio.Queue()
        self._queues[client_id] = queue
        return client_id, queue

    def close(self, client_id: int) -> None:
        self._queues.pop(client_id, None)
        self.overflowed.discard(client_id)
        self._kv_lagging.pop(client_id, None)

    def close_all(self) -> None:
        """End every stream (shutdown): their requests are aborted."""
        for queue in list(self._queues.values()):
            queue.put_nowait(_STREAM_CLOSED)

    def deliver(self, client_id: int, outputs: EngineCoreOutputs | KVEventBatch) -> None:
        """The busy loop's output sink (its thread): hand outputs over, never block."""
        self._loop.call_soon_threadsafe(self._put, client_id, outputs, time.perf_counter())

    def _put(self, client_id: int, item: EngineCoreOutputs | KVEventBatch, at: float) -> None:
        queue = self._queues.get(client_id)
        if queue is None or client_id in self.overflowed:
            return
        if queue.qsize() >= MAX_UNSENT_OUTPUTS:
            logger.error("stream %d left %d outputs unread; dropping it", client_id, queue.qsize())
            self.overflowed.add(client_id)
            self.on_overflow(client_id)
            return
        if isinstance(item, KVEventBatch) and item.is_snapshot:
            self._kv_lagging.pop(client_id, None)  # a snapshot: events flow again after it
        elif client_id in self._kv_lagging or queue.qsize() >= MAX_UNSENT_BEFORE_KV_RESYNC:
            if isinstance(item, KVEventBatch):
                self._drop_kv_events(client_id)
                return
            if item.kv_events:
                item.kv_events = None
                self._drop_kv_events(client_id)
        queue.put_nowait((item, at))

    def _drop_kv_events(self, client_id: int) -> None:
        if client_id not in self._kv_lagging:
            logger.warning(
                "stream %d is behind; dropping its KV-cache events until it catches up, "
                "then sending it the whole cache again",
                client_id,
            )
            self._kv_lagging[client_id] = False

    def needs_kv_resync(self, client_id: int, queue: asyncio.Queue[object]) -> bool:
        """True once (until the snapshot came) for a lagging client whose outbox is empty."""
        if self._kv_lagging.get(client_id) is False and queue.empty():
            self._kv_lagging[client_id] = True
            return True
        return False


class EngineCoreServicer(core_grpc.EngineCoreServiceServicer):
    """Handshake, EngineStream and GetSchedulerStats over one running EngineCoreProc."""

    def __init__(
        self,
        proc: EngineCoreProc,
        streams: ClientStreams,
        info: core_pb2.EngineInfo,
        metrics: CoreMetrics,
        profiling: bool = False,
        is_tracing: bool = False,
        loras: LoraAdmin | None = None,
    ) -> None:
        self._proc = proc
        self._profiling = profiling
        self._is_tracing = is_tracing
        """Keep the frontends' trace contexts (else requests go untraced)."""
        self._streams = streams
        self._info = info
        self._metrics = metrics
        self._loras = loras
        """LoRA adapters' loading and unloading (None: an engine without LoRA, as a fake's)."""
        streams.on_overflow = proc.inbox.close_client

    async def close_streams(self) -> None:
        """End every EngineStream (shutdown): their requests are aborted."""
        self._streams.close_all()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def Handshake(  # noqa: N802 (gRPC method name)
        self, request: core_pb2.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> core_pb2.HandshakeResponse:
        logger.info("handshake from %s", request.client_name or context.peer())
        return core_pb2.HandshakeResponse(engine_info=self._info)

    async def GetSchedulerStats(  # noqa: N802
        self, request: core_pb2.GetSchedulerStatsRequest, context: grpc.aio.ServicerContext
    ) -> core_pb2.GetSchedulerStatsResponse:
        stats = output_convert.scheduler_stats_to_proto(self._proc.latest_stats)
        bounds, counts, total = self._metrics.iteration_tokens_state()
        histogram = core_pb2.Histogram(upper_bounds=bounds, cumulative_counts=counts, sum=total)
        return core_pb2.GetSchedulerStatsResponse(scheduler_stats=stats, iteration_tokens=histogram)

    async def Profile(  # noqa: N802
        self, request: core_pb2.ProfileRequest, context: grpc.aio.ServicerContext
    ) -> core_pb2.ProfileResponse:
        """Start or stop the ranks' torch profilers, between two steps (--profiler-config)."""
        command = request.command
        if not self._profiling:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "profiling is off: start the engine with --profiler-config",
            )
        if command.action not in (
            common_pb2.PROFILE_ACTION_START,
            common_pb2.PROFILE_ACTION_STOP,
        ):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "action: start or stop")
        try:
            prefix = check_profile_prefix(command.prefix)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        done = asyncio.wrap_future(self._proc.inbox.profile(command.action, prefix))
        try:
            refused = await asyncio.wait_for(done, RESET_PREFIX_CACHE_TIMEOUT_S)
        except TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine loop did not answer")
        if refused:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "these ranks cannot profile")
        logger.info("profiler %s", "started" if command.action == 1 else "stopped")
        return core_pb2.ProfileResponse()

    async def ResetPrefixCache(  # noqa: N802
        self, request: core_pb2.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> core_pb2.ResetPrefixCacheResponse:
        done = asyncio.wrap_future(self._proc.inbox.reset_prefix_cache())
        try:
            num_used_blocks = await asyncio.wait_for(done, RESET_PREFIX_CACHE_TIMEOUT_S) or 0
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the engine loop did not answer; retry later"
            )
        if num_used_blocks:
            logger.info("prefix cache reset refused: requests hold %d KV blocks", num_used_blocks)
        else:
            logger.info("prefix cache reset")
        return core_pb2.ResetPrefixCacheResponse(
            reset=num_used_blocks == 0, num_used_blocks=num_used_blocks
        )

    def _lora_admin(self) -> LoraAdmin:
        if self._loras is None:
            raise LoraError(LoraErrorKind.OFF, LORA_OFF)
        return self._loras

    async def LoadLoraAdapter(  # noqa: N802
        self, request: core_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> core_pb2.LoadLoraAdapterResponse:
        try:
            adapter = await self._lora_admin().load(
                request.lora_name, request.lora_path, request.base_model_name, request.load_inplace
            )
        except LoraError as err:
            await context.abort(LORA_STATUS[err.kind], str(err))
        return core_pb2.LoadLoraAdapterResponse(adapter=convert.lora_adapter_to_proto(adapter))

    async def UnloadLoraAdapter(  # noqa: N802
        self, request: core_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> core_pb2.UnloadLoraAdapterResponse:
        try:
            num_requests = await self._lora_admin().unload(request.lora_name)
        except LoraError as err:
            await context.abort(LORA_STATUS[err.kind], str(err))
        return core_pb2.UnloadLoraAdapterResponse(num_requests=num_requests)

    async def ListLoraAdapters(  # noqa: N802
        self, request: core_pb2.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> core_pb2.ListLoraAdaptersResponse:
        adapters = self._loras.registry.adapters.values() if self._loras is not None else ()
        return core_pb2.ListLoraAdaptersResponse(
            adapters=[convert.lora_adapter_to_proto(a) for a in adapters]
        )

    async def EngineStream(  # noqa: N802
        self,
        request_iterator: AsyncIterator[core_pb2.EngineStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[core_pb2.EngineStreamResponse]:
        proc = self._proc
        client_id, queue = self._streams.open()
        self._metrics.streams.set(len(self._streams))
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
                payload, handed_at = cast(tuple[EngineCoreOutputs | KVEventBatch, float], item)
                if isinstance(payload, KVEventBatch):
                    response = core_pb2.EngineStreamResponse()
                    convert.kv_events_to_proto(payload.events, response.kv_events)
                    yield response
                else:
                    yield convert.stream_response_to_proto(payload)
                    self._metrics.output_send_seconds.observe(time.perf_counter() - handed_at)
                if client_id in self._streams.overflowed:
                    return
                if self._streams.needs_kv_resync(client_id, queue):
                    proc.inbox.subscribe_kv_events(client_id)
        finally:
            self._streams.close(client_id)
            self._metrics.streams.set(len(self._streams))
            proc.inbox.close_client(client_id)
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
        loras = self._loras.registry if self._loras is not None else None
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("payload")
                if kind == "add":
                    now = time.monotonic()
                    proc.inbox.add_requests(
                        client_id,
                        [
                            convert.request_from_proto(r, client_id, now, self._is_tracing, loras)
                            for r in msg.add.requests
                        ],
                    )
                elif kind == "abort":
                    proc.inbox.abort_requests(client_id, list(msg.abort.request_handles))
                elif kind == "tokenizer":
                    info = msg.tokenizer
                    proc.inbox.set_tokenizer(
                        client_id, info.tokenizer_json, list(info.eos_token_ids)
                    )
                elif kind == "ping":
                    queue.put_nowait(
                        core_pb2.EngineStreamResponse(pong=core_pb2.Pong(ping_id=msg.ping.ping_id))
                    )
                elif kind == "subscribe_kv_events":
                    proc.inbox.subscribe_kv_events(client_id)
        except grpc.RpcError:
            pass
        finally:
            queue.put_nowait(_STREAM_CLOSED)
