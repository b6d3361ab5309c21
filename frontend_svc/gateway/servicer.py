"""The standard engine contract on the frontend: the VllmEngine service of smg-grpc-proto, the
one the Shepherd Model Gateway (`smg`) drives vLLM engines with, served beside
GenerationService on the public port (same API key, limits, validation and error statuses).

Thin: requests go through gateway/convert.py into the same InputProcessor and AsyncEngine as
the public API; KV-cache events come from the KvEventHub, load records from LoadReporter.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_servicer.load_record import LoadRecorder, engine_load_from
from smg_grpc_servicer.tokenizer_bundle import tokenizer_chunks

from frontend_svc import grpc_errors
from frontend_svc.engine.async_engine import AsyncEngine
from frontend_svc.engine.engine_types import EngineInfo
from frontend_svc.errors import FrontendError, InvalidRequest, engine_error
from frontend_svc.gateway import convert, kv_params
from frontend_svc.gateway.loads import LoadReporter
from frontend_svc.gateway.tokenizer_files import TokenizerFiles
from frontend_svc.inputs.input_processor import InputProcessor
from frontend_svc.inputs.model_files import ModelFiles
from frontend_svc.kv_events.hub import KvEventHub, TooManySubscribers
from frontend_svc.kv_transfer import has_kv_connector
from frontend_svc.serving import pooling
from frontend_svc.tracing import set_caller_trace
from splitserve_contracts.output_types import FinishReason

logger = logging.getLogger(__name__)
RESET_RPC_TIMEOUT_S = 30.0
RESET_RETRY_S = 0.1
EVENTS_OFF = (
    "KV cache events are not enabled on this engine; start the frontend with "
    "--kv-events-config '{\"enable_kv_cache_events\": true}'"
)


class PrefixCacheControl(Protocol):
    async def reset_prefix_cache(self, timeout: float) -> int:
        """0 when the engine forgot its prefix cache, else the KV blocks requests hold."""
        ...


class ProfileControl(Protocol):
    async def profile(self, action: int, prefix: str, timeout: float = 60.0) -> None:
        """Start (1) or stop (2) the worker ranks' torch profilers."""
        ...


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    """Generate, Abort, HealthCheck, GetModelInfo, GetServerInfo, GetLoads, GetTokenizer,
    SubscribeKvEvents, FlushCache, StartProfile/StopProfile (with --profiler-config, else
    UNIMPLEMENTED as before), Embed (a pooling model)."""

    def __init__(
        self,
        engine: AsyncEngine,
        inputs: InputProcessor,
        info: EngineInfo,
        files: ModelFiles,
        served_model_name: str,
        kv_events: KvEventHub | None,
        prefix_cache: PrefixCacheControl,
        data_parallel_rank: int = 0,
        profiler: ProfileControl | None = None,
    ) -> None:
        self.engine = engine
        self.profiler = profiler
        """The ranks' profilers (None: --profiler-config is off)."""
        self.inputs = inputs
        self.info = info
        self.files = files
        self.served_model_name = served_model_name
        self.kv_events = kv_events
        self.prefix_cache = prefix_cache
        self.data_parallel_rank = data_parallel_rank
        self.has_kv_connector = has_kv_connector(info)
        """--kv-transfer-config named a connector: kv_transfer_params_json is taken."""
        self.loads = LoadReporter(info, lambda: engine.scheduler_stats)
        self.tokenizer_files = TokenizerFiles(files.tokenizer, files.tokenizer_folder)
        self.started_at = time.monotonic()
        self.last_receive_timestamp = 0.0

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.monotonic()
        self.last_receive_timestamp = time.time()
        request_id = request.request_id or f"gen-{uuid.uuid4().hex[:16]}"
        inputs = self.inputs
        set_caller_trace(dict(context.invocation_metadata() or ()))  # the gateway's traceparent
        try:
            convert.check_request_fields(request, self.data_parallel_rank)
            kv_json = kv_params.kv_transfer_params_json(request, self.has_kv_connector)
            pooling.check_generative(self.info, "Generate RPC")
            call = convert.generate_input_from_proto(
                request, request_id, self.info.max_model_len, kv_json
            )
            engine_request = await inputs.run(inputs.process, call)
            builder = convert.ResponseBuilder(
                engine_request.params, engine_request.prompt_token_ids, request.stream
            )
            abortable = bool(request.request_id)
            async for delta in self.engine.generate(engine_request, arrival, abortable=abortable):
                if delta.finish_reason == FinishReason.ERROR:
                    raise engine_error(request_id, delta.error_kind, delta.error_message)
                for response in builder.responses(delta):
                    yield response
        except FrontendError as err:
            await grpc_errors.abort(context, err)

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        ids = list(request.request_ids)
        try:
            if len(ids) > convert.MAX_ABORT_IDS:
                raise InvalidRequest(
                    f"{len(ids)} request ids; at most {convert.MAX_ABORT_IDS} per call",
                    "request_ids",
                )
        except FrontendError as err:
            await grpc_errors.abort(context, err)
        self.engine.abort(ids)
        return pb.AbortResponse()

    async def HealthCheck(  # noqa: N802
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        if self.engine.is_ready:
            return pb.HealthCheckResponse(healthy=True, message="Health")
        reason = "draining" if self.engine.is_draining else "the engine core is not serving"
        return pb.HealthCheckResponse(healthy=False, message=f"not ready: {reason}")

    async def GetModelInfo(  # noqa: N802
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        files = self.files
        eos = [self.inputs.eos_token_id] if self.inputs.eos_token_id is not None else []
        return convert.model_info_to_proto(
            self.info,
            self.served_model_name,
            files.tokenizer,
            [*eos, *self.inputs.extra_eos_ids],
            files.sampling_defaults,
            files.model_config,
        )

    async def GetServerInfo(  # noqa: N802
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        return convert.server_info_to_proto(
            self.info,
            active_requests=self.engine.num_running,
            is_paused=self.engine.is_draining,
            last_receive_timestamp=self.last_receive_timestamp,
            uptime_seconds=time.monotonic() - self.started_at,
            data_parallel_size=1,
        )

    async def GetLoads(  # noqa: N802
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadsResponse:
        load = convert.scheduler_load_to_proto(self.loads.load(), self.data_parallel_rank)
        return pb.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version="splitserve",
            dp_rank_count=1,
            loads=[load],
        )

    async def GetTokenizer(  # noqa: N802
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        try:
            data, sha256 = await self.tokenizer_files.archive()
        except Exception:
            logger.exception("building the tokenizer archive failed")
            await context.abort(grpc.StatusCode.INTERNAL, "the tokenizer files cannot be read")
        for chunk in tokenizer_chunks(data, sha256):
            yield chunk

    async def SubscribeKvEvents(  # noqa: N802
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        hub = self.kv_events
        if hub is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, EVENTS_OFF)
            return
        if request.start_sequence_number:
            await context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                "sequence numbers count per subscription and nothing is kept between them; "
                "subscribe from 0: the first batches carry the whole cache",
            )
        try:
            subscriber = hub.subscribe()
        except TooManySubscribers as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{err}; retry later")
            return
        recorder = LoadRecorder(self._load_record)
        sequence = event_id = 0
        try:
            while True:
                try:
                    timeout = recorder.poll_timeout(1.0)
                    batches = await asyncio.wait_for(hub.next_batches(subscriber), timeout)
                except TimeoutError:
                    heartbeat = recorder.heartbeat()
                    if heartbeat is not None:
                        yield heartbeat
                    continue
                for events in batches:
                    sequence += 1
                    batch = convert.kv_batch_to_proto(
                        events, sequence, time.time(), hub.block_size, event_id + 1
                    )
                    event_id += len(events)
                    yield recorder.stamp(batch)
        finally:
            hub.unsubscribe(subscriber)

    def _load_record(self, dp_rank: int | None) -> Any:
        load = self.loads.load()
        record = engine_load_from(
            convert.scheduler_load_to_proto(load, self.data_parallel_rank), queued_token_work=True
        )
        convert.add_lora_load(load, record)
        return record

    async def FlushCache(  # noqa: N802
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        """vLLM's FlushCache: reset the prefix cache, refused while requests hold KV blocks;
        with timeout_s, retry until the engine is idle or the time is up."""
        try:
            convert.check_flush_timeout(request.timeout_s)
        except FrontendError as err:
            await grpc_errors.abort(context, err)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request.timeout_s
        while True:
            try:
                num_used_blocks = await self.prefix_cache.reset_prefix_cache(RESET_RPC_TIMEOUT_S)
            except grpc.RpcError as err:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the engine core did not answer ({err.code().name})",
                )
            if num_used_blocks == 0:
                return common_pb2.FlushCacheResponse(
                    success=True, message="Local KV prefix cache flushed successfully"
                )
            if loop.time() >= deadline:
                break
            await asyncio.sleep(min(RESET_RETRY_S, max(0.0, deadline - loop.time())))
        message = f"KV prefix cache reset refused: requests hold {num_used_blocks} KV blocks"
        if request.timeout_s > 0:
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details(f"{message} after {request.timeout_s:g} s")
        return common_pb2.FlushCacheResponse(success=False, message=message)

    async def Embed(  # noqa: N802
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        """One tokenized input's embedding (an engine serving a pooling model: --runner
        pooling); UNIMPLEMENTED from an engine serving a generative model."""
        self.last_receive_timestamp = time.time()
        if self.info.pooler_config is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "Embed: this engine serves a generative model; serve a pooling model "
                "(--runner pooling) for embeddings",
            )
            raise AssertionError("unreachable")
        request_id = request.request_id or f"embd-{uuid.uuid4().hex[:16]}"
        inputs = self.inputs
        try:
            config = pooling.pooler_config(self.info, "Embed RPC")
            prompt = convert.embed_input_from_proto(request)
            engine_request = await inputs.run(
                pooling.embed_request, inputs, request_id, prompt, "tokenized.input_ids"
            )
            embedded = await pooling.embed_all(self.engine, [engine_request], config, None)
        except FrontendError as err:
            await grpc_errors.abort(context, err)
        return convert.embedding_to_proto(embedded[0])

    async def StartProfile(  # noqa: N802
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        """The torch profiler on every rank, as /start_profile: the trace folder and what is
        recorded are the engine's --profiler-config; a request may not choose them."""
        chosen = [f.name for f, _ in request.ListFields() if f.name in PEER_CHOSEN]
        if chosen:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{', '.join(chosen)}: set by the engine's --profiler-config, not per request",
            )
        return await self._profile(PROFILE_START, context)

    async def StopProfile(  # noqa: N802
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        return await self._profile(PROFILE_STOP, context)

    async def _profile(
        self, action: int, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        if self.profiler is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, PROFILING_OFF)
            raise AssertionError("unreachable")
        try:
            await self.profiler.profile(action, "")
        except grpc.RpcError as err:
            return common_pb2.ProfileResponse(success=False, message=err.details() or "")
        return common_pb2.ProfileResponse(success=True, message="")


PROFILING_OFF = "profiling is off: start the engine with --profiler-config (vLLM's flag)"
PROFILE_START, PROFILE_STOP = 1, 2
PEER_CHOSEN = frozenset({"output_dir", "start_step", "num_steps"})
"""StartProfileRequest fields a gateway may not set: the engine's flag decides them."""
