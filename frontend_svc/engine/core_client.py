"""EngineCoreClient: one bidirectional stream to the engine core, all requests multiplexed.

Adds and aborts go through one ordered outbox; consecutive messages of the same kind are
coalesced into one wire message. What comes back is a single ordered stream of events for the
frontend's engine to pull (`next_event`): each step's outputs, ping round trips, the core's
scheduler stats when no outputs brought them for a while (`StatsRefresh`), `Disconnected` when
the stream breaks and `Reconnected` when a new one is open. After a break the client reconnects
(Handshake, then a new stream), but only once the consumer has taken the `Disconnected` event, so
the requests it pauses (or fails) are exactly those of the broken stream; on `Reconnected` it may
resubmit them (`resubmit_requests`). Reconnecting is gRPC's own: the channel retries the
connection with its backoff (0.1 s growing to `max_backoff`) and the Handshake waits for it
(`wait_for_ready`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from frontend_svc.engine import core_convert
from frontend_svc.engine.core_events import CoreClient as CoreClient
from frontend_svc.engine.core_events import (
    CoreEvent,
    Disconnected,
    Reconnected,
    RoundTrip,
    StatsRefresh,
)
from frontend_svc.engine.engine_types import (
    EngineInfo,
    EngineSnapshot,
    LoraAdapterInfo,
    TokenizerInfo,
)
from frontend_svc.errors import EngineUnavailable
from frontend_svc.kv_events.hub import AllBlocksCleared, KvEvents
from frontend_svc.requests import EngineRequest
from splitserve_contracts.common.v1 import types_pb2 as common_pb2
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from splitserve_contracts.output_convert import scheduler_stats_from_proto
from splitserve_runtime.channels import ChannelSecurity, open_aio_channel
from splitserve_runtime.grpc_client_metrics import GrpcClientMetrics
from splitserve_runtime.services import CORE
from splitserve_runtime.tls import CORE_ROLE

logger = logging.getLogger(__name__)
HANDSHAKE_WAIT_SECONDS = 10.0
"""How long one Handshake waits for the channel to connect before the wait is logged."""
STATS_MAX_AGE_S = 1.0
"""The core's scheduler stats (the engine gauges this frontend exports) come with this frontend's
outputs; when none brought them for this long - this frontend idle while others keep the engine
busy, or the engine idle - the client asks the core (GetSchedulerStats)."""


class EngineCoreClient:
    """The frontend's end of EngineCoreService.EngineStream."""

    def __init__(
        self,
        core_addr: str,
        max_backoff: float = 1.0,
        ping_interval: float = 1.0,
        security: ChannelSecurity | None = None,
        tokenizer: TokenizerInfo | None = None,
        subscribe_kv_events: bool = False,
        grpc_metrics: GrpcClientMetrics | None = None,
    ) -> None:
        self.core_addr = core_addr
        self.subscribe_kv_events = subscribe_kv_events
        """Ask every stream for the engine's KV-cache events (they arrive as KvEvents)."""
        self._tokenizer_msg = (
            None if tokenizer is None else core_convert.tokenizer_info_to_proto(tokenizer)
        )
        """Sent first on every stream: the core compiles structured outputs with it."""
        self.max_backoff = max_backoff
        self.ping_interval = ping_interval
        self._events: asyncio.Queue[CoreEvent] = asyncio.Queue()
        self._pings: dict[int, float] = {}
        self._ping_ids = itertools.count(1)
        self.num_reconnects = 0
        self._handles = itertools.count(1)
        security = security or ChannelSecurity(None, CORE_ROLE)
        self._metadata = security.call_metadata()
        self._channel = open_aio_channel(
            core_addr,
            security,
            extra_options=(
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", int(max_backoff * 1000)),
            ),
            metrics=grpc_metrics,
        )
        self._stub = core_grpc.EngineCoreServiceStub(self._channel)
        self._outbox: asyncio.Queue[core_pb2.EngineStreamRequest] = asyncio.Queue()
        self._connected = asyncio.Event()
        self._is_core_serving = True
        self._state_changed = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None
        self._client_name = f"frontend@{socket.gethostname()}:{os.getpid()}"
        self.info: EngineInfo | None = None
        """The engine's facts at the first handshake."""
        self._stats_at = time.monotonic()

    @property
    def is_connected(self) -> bool:
        """The stream to the core is up and the core reports itself SERVING (its readiness,
        watched through grpc.health.v1): only then are requests sent."""
        return self._connected.is_set() and self._is_core_serving

    async def wait_state_change(self) -> bool:
        """Wait until the stream goes up or down; returns whether it is up now."""
        await self._state_changed.wait()
        self._state_changed.clear()
        return self.is_connected

    def next_handle(self) -> int:
        """A handle never used before on this client (handles are never reused)."""
        return next(self._handles)

    async def next_event(self) -> CoreEvent:
        return await self._events.get()

    def event_done(self) -> None:
        self._events.task_done()

    async def connect(self, timeout: float) -> EngineInfo:
        """Handshake (retrying until `timeout`), open the stream, keep it open from now on."""
        info = await asyncio.wait_for(self._handshake_until_ok(), timeout)
        self.info = info
        self._supervisor = asyncio.create_task(self._supervise())
        await asyncio.wait_for(self._connected.wait(), timeout)
        return info

    async def _handshake_until_ok(self) -> EngineInfo:
        """Handshake as soon as the channel connects (gRPC reconnects it with its backoff); an
        error the core itself answers is retried a second later."""
        request = core_pb2.HandshakeRequest(client_name=self._client_name)
        while True:
            try:
                reply = await self._stub.Handshake(
                    request,
                    timeout=HANDSHAKE_WAIT_SECONDS,
                    wait_for_ready=True,
                    metadata=self._metadata,
                )
                return core_convert.engine_info_from_proto(reply.engine_info)
            except grpc.RpcError as err:
                state = self._channel.get_state().name
                logger.info(
                    "waiting for the engine core at %s (%s, channel %s)",
                    self.core_addr,
                    err.code().name,
                    state,
                )
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    await asyncio.sleep(min(1.0, self.max_backoff))

    async def _supervise(self) -> None:
        """Keep one stream open; after a break, reconnect with backoff."""
        reconnected: Reconnected | None = None
        while True:
            reason = await self._run_stream(reconnected)
            self._connected.clear()
            self._state_changed.set()
            self._events.put_nowait(Disconnected(reason))
            await self._events.join()  # the consumer paused or failed the stream's requests
            self.num_reconnects += 1
            logger.warning(
                "stream to engine core %s broke (%s); reconnecting", self.core_addr, reason
            )
            info = await self._handshake_until_ok()
            reconnected = Reconnected(_change_problem(self.info, info))

    async def _run_stream(self, reconnected: Reconnected | None) -> str:
        self._outbox = asyncio.Queue()
        if self._tokenizer_msg is not None:
            self._outbox.put_nowait(self._tokenizer_msg)
        self._pings.clear()
        if self.subscribe_kv_events:
            subscribe = core_pb2.SubscribeKvEvents()
            self._outbox.put_nowait(core_pb2.EngineStreamRequest(subscribe_kv_events=subscribe))
        call = self._stub.EngineStream(metadata=self._metadata)
        tasks = [
            asyncio.create_task(self._write(call)),
            asyncio.create_task(self._ping()),
            asyncio.create_task(self._watch_core_health()),
            asyncio.create_task(self._refresh_stats()),
        ]
        self._connected.set()
        self._state_changed.set()
        if reconnected is not None:
            self._events.put_nowait(reconnected)
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    return "the engine core closed the stream"
                if msg.HasField("pong"):
                    self._on_pong(msg.pong.ping_id)
                    continue
                if msg.HasField("kv_events"):
                    self._events.put_nowait(self._kv_events(msg.kv_events))
                if msg.HasField("outputs"):
                    outputs = core_convert.core_outputs_from_proto(msg.outputs)
                    if outputs.scheduler_stats is not None:
                        self._stats_at = time.monotonic()
                    self._events.put_nowait(outputs)
        except grpc.RpcError as err:
            return f"{err.code().name}: {err.details()}"
        finally:
            call.cancel()
            for task in tasks:
                task.cancel()
            # asyncio.wait, not `await task` under suppress(CancelledError): a cancellation of
            # this (supervisor) task arriving here must propagate, not be swallowed.
            await asyncio.wait(tasks)

    def _kv_events(self, msg: core_pb2.KvCacheEvents) -> KvEvents:
        assert self.info is not None
        try:
            return core_convert.kv_events_from_proto(msg, self.info.options.cache.block_size)
        except ValueError as err:
            # The mirror can no longer be trusted: start over empty (it converges as the
            # engine caches blocks again) rather than serve a wrong view.
            logger.error("malformed KV-cache events from the engine core (%s); clearing", err)
            return KvEvents([AllBlocksCleared()])

    async def _watch_core_health(self) -> None:
        """Follow the core's readiness; a core that stops serving (failed, draining) makes this
        frontend not ready too, and its new requests get UNAVAILABLE at once."""
        request = health_pb2.HealthCheckRequest(service=CORE.grpc_service)
        try:
            async for reply in health_pb2_grpc.HealthStub(self._channel).Watch(request):
                is_serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                if is_serving != self._is_core_serving:
                    self._is_core_serving = is_serving
                    self._state_changed.set()
                    logger.warning("engine core %s is %sserving", self.core_addr,
                                   "" if is_serving else "not ")  # fmt: skip
        except grpc.RpcError:
            return  # the stream's own read reports the break

    async def _refresh_stats(self) -> None:
        """Fetch the core's scheduler stats when no outputs brought them for STATS_MAX_AGE_S."""
        request = core_pb2.GetSchedulerStatsRequest()
        while True:
            await asyncio.sleep(STATS_MAX_AGE_S)
            if time.monotonic() - self._stats_at < STATS_MAX_AGE_S:
                continue
            try:
                reply = await self._stub.GetSchedulerStats(
                    request, timeout=5.0, metadata=self._metadata
                )
            except grpc.RpcError:
                continue  # the stream's own read reports a break
            self._stats_at = time.monotonic()
            stats = scheduler_stats_from_proto(reply.scheduler_stats)
            self._events.put_nowait(StatsRefresh(stats))

    async def _ping(self) -> None:
        """Time the hop to the core in this process's clock (the core echoes off its loop)."""
        while True:
            await asyncio.sleep(self.ping_interval)
            ping_id = next(self._ping_ids)
            self._pings[ping_id] = time.monotonic()
            self._outbox.put_nowait(
                core_pb2.EngineStreamRequest(ping=core_pb2.Ping(ping_id=ping_id))
            )

    def _on_pong(self, ping_id: int) -> None:
        sent = self._pings.pop(ping_id, None)
        if sent is not None:
            self._events.put_nowait(RoundTrip(time.monotonic() - sent))

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            first = await self._outbox.get()
            batch = [first]
            while not self._outbox.empty():
                batch.append(self._outbox.get_nowait())
            for msg in core_convert.coalesce(batch):
                await call.write(msg)

    def add_requests(self, requests: list[tuple[int, EngineRequest]]) -> None:
        """Queue requests (with their handles) for the core; raises EngineUnavailable when the
        stream is down."""
        if not self.is_connected:
            raise EngineUnavailable(
                "the engine core is unreachable or not serving; retry shortly",
                detail=f"engine core at {self.core_addr}",
            )
        self._send_add(requests)

    def resubmit_requests(self, requests: list[tuple[int, EngineRequest]]) -> None:
        """Queue requests of a broken stream again (with the outputs they have) on the new
        one, whether or not the core reports itself serving yet; a no-op while disconnected."""
        if requests and self._connected.is_set():
            self._send_add(requests)

    def _send_add(self, requests: list[tuple[int, EngineRequest]]) -> None:
        add = core_pb2.AddRequests(
            requests=[core_convert.engine_request_to_proto(h, r) for h, r in requests]
        )
        self._outbox.put_nowait(core_pb2.EngineStreamRequest(add=add))

    async def list_lora_adapters(self, timeout: float = 10.0) -> list[LoraAdapterInfo]:
        """The engine's LoRA adapters (grpc.RpcError when the core does not answer)."""
        request = core_pb2.ListLoraAdaptersRequest()
        reply = await self._stub.ListLoraAdapters(request, timeout=timeout, metadata=self._metadata)
        return [core_convert.lora_adapter_from_proto(a) for a in reply.adapters]

    async def load_lora_adapter(
        self, name: str, path: str, load_inplace: bool, timeout: float
    ) -> LoraAdapterInfo:
        """Load an adapter on every rank (grpc.RpcError: the core's refusal, or no answer)."""
        request = core_pb2.LoadLoraAdapterRequest(
            lora_name=name, lora_path=path, load_inplace=load_inplace
        )
        reply = await self._stub.LoadLoraAdapter(request, timeout=timeout, metadata=self._metadata)
        return core_convert.lora_adapter_from_proto(reply.adapter)

    async def unload_lora_adapter(self, name: str, timeout: float) -> int:
        """Unload an adapter; the requests still running it (grpc.RpcError: refused)."""
        request = core_pb2.UnloadLoraAdapterRequest(lora_name=name)
        reply = await self._stub.UnloadLoraAdapter(
            request, timeout=timeout, metadata=self._metadata
        )
        return reply.num_requests

    async def engine_snapshot(self, timeout: float) -> EngineSnapshot:
        """The core's scheduler stats and step histogram now (the serving port's /metrics).
        Raises grpc.RpcError when the core does not answer."""
        request = core_pb2.GetSchedulerStatsRequest()
        reply = await self._stub.GetSchedulerStats(
            request, timeout=timeout, metadata=self._metadata
        )
        return core_convert.engine_snapshot_from_proto(reply)

    async def profile(self, action: int, prefix: str, timeout: float = 60.0) -> None:
        """Start (1) or stop (2) the worker ranks' torch profilers (the core's --profiler-config)
        between two steps. Raises grpc.RpcError (FAILED_PRECONDITION: profiling is off)."""
        command = common_pb2.ProfileCommand(action=action, prefix=prefix)  # type: ignore[arg-type]
        request = core_pb2.ProfileRequest(command=command)
        await self._stub.Profile(request, timeout=timeout, metadata=self._metadata)

    async def reset_prefix_cache(self, timeout: float) -> int:
        """Ask the core to forget its prefix cache: 0 when it did, else the number of KV blocks
        requests hold (it refused). Raises grpc.RpcError when the core does not answer."""
        request = core_pb2.ResetPrefixCacheRequest()
        reply = await self._stub.ResetPrefixCache(request, timeout=timeout, metadata=self._metadata)
        return 0 if reply.reset else max(1, reply.num_used_blocks)

    def abort_requests(self, handles: list[int]) -> None:
        """Queue an abort, also while the core is not serving (its requests wait there); a
        no-op while disconnected (the core already dropped them)."""
        if handles and self._connected.is_set():
            abort = core_pb2.AbortRequests(request_handles=handles)
            self._outbox.put_nowait(core_pb2.EngineStreamRequest(abort=abort))

    async def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.wait([self._supervisor], timeout=5.0)
        await self._channel.close()


def _change_problem(before: EngineInfo | None, after: EngineInfo) -> str:
    """Why requests of the engine `before` cannot continue on `after` ("" when they can)."""
    if before is None:
        return ""
    for name in ("served_model_name", "vocab_size", "max_model_len"):
        old, new = getattr(before, name), getattr(after, name)
        if old != new:
            return f"the engine core now reports {name} {new!r}, not {old!r}"
    return ""
