"""WorkerServicer: the grpc.aio face of one rank.

All model work (loading, KV allocation, steps, shutdown) runs on one dedicated thread, in call
order, so the event loop stays free for health checks and the model never sees two threads.
Execute is the bidirectional step stream: each ExecuteRequest runs in order; the output rank
answers every step, other ranks answer only with errors. A failed step poisons the rank (its
per-request state may be half-updated): every later step is answered with the same error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import grpc
from prometheus_client import CollectorRegistry

from splitserve.worker.v1 import worker_service_pb2 as pb
from splitserve.worker.v1 import worker_service_pb2_grpc as pb_grpc
from worker_svc import convert
from worker_svc.metrics import WorkerMetrics
from worker_svc.worker import Worker, WorkerStateError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    """Serves WorkerService for one rank.

    `device` is "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N";
    `rank_hint` picks the CUDA device under "auto" (rank % device count) before LoadModel
    says the real rank. With a Prometheus `registry`, step metrics (worker_svc.metrics) are
    recorded once LoadModel has named the model, engine and rank.
    """

    def __init__(
        self, device: str = "auto", rank_hint: int = 0, registry: CollectorRegistry | None = None
    ) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-model")
        self._worker = Worker(device, rank_hint)
        self._registry = registry
        self._metrics: WorkerMetrics | None = None
        self._last_step_id = 0
        self._failure: str | None = None
        self._is_closed = False

    @property
    def worker(self) -> Worker:
        return self._worker

    async def _on_model_thread(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(fn, *args))

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` on the model thread, turning our exceptions into gRPC status codes."""
        try:
            return await self._on_model_thread(fn, *args)
        except WorkerStateError as e:
            status, message = grpc.StatusCode.FAILED_PRECONDITION, str(e)
        except (ValueError, FileNotFoundError) as e:
            status, message = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except Exception as e:  # noqa: BLE001 (reported to the caller, logged here)
            logger.exception("worker call %s failed", getattr(fn, "__name__", fn))
            status, message = grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
        await _abort(context, status, message)

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        description = await self._call(context, self._worker.describe)
        return convert.description_to_proto(description)

    async def LoadModel(
        self, request: pb.LoadModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadModelResponse:
        try:
            config = convert.load_model_config_from_proto(request)
        except ValueError as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self._last_step_id, self._failure = 0, None  # a (re)starting core counts steps from 1
        logger.info("loading %s as rank %d (tp=%d, pp=%d, dtype=%s)",
                    config.model_path or "the embedded default model",
                    config.rank, config.tensor_parallel_size, config.pipeline_parallel_size,
                    config.dtype)
        loaded = await self._call(context, self._worker.load_model, config)
        if self._registry is not None and self._metrics is None:
            self._metrics = WorkerMetrics(
                self._registry, request.served_model_name or config.model_path,
                request.engine_id, config.rank,
            )
        logger.info("loaded %s: %d layers, %s, %.1f MB in %.2fs, attention %s",
                    loaded.architecture, loaded.num_layers, loaded.dtype,
                    loaded.weight_bytes / 1e6, loaded.load_seconds, loaded.attention_backend)
        return convert.loaded_model_to_proto(loaded)

    async def GetKvCapacity(
        self, request: pb.GetKvCapacityRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetKvCapacityResponse:
        capacity = await self._call(
            context, self._worker.get_kv_capacity, request.block_size,
            request.gpu_memory_utilization, request.kv_cache_memory_bytes,
        )
        return convert.kv_capacity_to_proto(capacity)

    async def InitializeKvCache(
        self, request: pb.InitializeKvCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.InitializeKvCacheResponse:
        nbytes = await self._call(
            context, self._worker.initialize_kv_cache, request.num_blocks, request.block_size
        )
        return pb.InitializeKvCacheResponse(kv_cache_bytes=nbytes)

    async def Execute(
        self,
        request_iterator: AsyncIterator[pb.ExecuteRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ExecuteResponse]:
        if not self._worker.is_kv_cache_ready:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                         "Execute needs LoadModel and InitializeKvCache first")
        async for request in request_iterator:
            response = await self._on_model_thread(self._execute_step, request)
            if response is not None:
                yield response

    def _execute_step(self, request: pb.ExecuteRequest) -> pb.ExecuteResponse | None:
        """One step on the model thread; None when this rank has nothing to say."""
        received = time.perf_counter()
        step_id = request.scheduler_output.step_id
        rank = self._worker.parallel.rank
        if self._failure is None and step_id != self._last_step_id + 1:
            self._failure = (f"step {step_id} arrived after step {self._last_step_id}; "
                             f"steps must be consecutive")
        if self._failure is not None:
            return _error_response(step_id, rank, f"rank {rank} has failed: {self._failure}")
        try:
            output = self._worker.execute(convert.scheduler_output_from_proto(request.scheduler_output))
        except Exception as e:  # noqa: BLE001 (every failure becomes a STEP_STATUS_ERROR)
            logger.exception("step %d failed on rank %d", step_id, rank)
            self._failure = f"step {step_id} failed: {type(e).__name__}: {e}"
            return _error_response(step_id, rank, f"rank {rank}: {self._failure}")
        self._last_step_id = step_id
        total_seconds = time.perf_counter() - received
        if self._metrics is not None:
            self._metrics.observe_step(
                output, request.scheduler_output.total_num_scheduled_tokens, total_seconds,
                None if output is None else output.num_used_kv_blocks,
            )
        if output is None:
            return None
        timings = dataclasses.replace(output.timings, total_seconds=total_seconds)
        output = dataclasses.replace(output, timings=timings)
        return pb.ExecuteResponse(model_runner_output=convert.model_runner_output_to_proto(output))

    async def close(self, timeout_seconds: float = 30.0) -> None:
        """Release the model and the process group, then stop the model thread. A model thread
        stuck in a collective (a peer rank died) is abandoned after `timeout_seconds`."""
        if self._is_closed:
            return
        self._is_closed = True
        try:
            await asyncio.wait_for(self._on_model_thread(self._worker.shutdown), timeout_seconds)
        except TimeoutError:
            logger.warning("the model thread did not finish within %.0fs; abandoning it",
                           timeout_seconds)
            self._thread.shutdown(wait=False, cancel_futures=True)
            return
        self._thread.shutdown(wait=True)

    shutdown = close


def _error_response(step_id: int, rank: int, message: str) -> pb.ExecuteResponse:
    return pb.ExecuteResponse(
        model_runner_output=convert.error_output_to_proto(step_id, rank, message)
    )


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # grpc.aio raises; keeps mypy informed
