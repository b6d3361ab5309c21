"""WorkerServicer: the gRPC face of one rank, on a synchronous server.

Every RPC runs on a thread of its own (splitserve_runtime.sync_service_host.ThreadPerRpcExecutor) that
ends with it. torch's OpenMP thread team belongs to the thread that starts it, and a second live
team roughly halves CPU throughput, so the model must only ever be driven from one live thread:
unary calls (LoadModel, KV sizing and warm-up) run one at a time on their short-lived threads,
and an Execute stream runs its steps in order on one step thread of its own, which takes the
requests a reader thread received ahead of it (worker_svc/stream/request_stream.py) and hands each
output to the stream's RPC thread to write while the next step runs (worker_svc/stream/output_stream.py):
the step path never waits for the network. Execute is the
bidirectional step stream: each ExecuteRequest runs in order; the output rank answers every step,
other ranks answer only with errors. A failed step poisons the rank (its per-request state may be
half-updated): every later step is answered with the same error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc
import torch
from prometheus_client import CollectorRegistry

from splitserve_contracts.worker.v1 import worker_service_pb2 as pb
from splitserve_contracts.worker.v1 import worker_service_pb2_grpc as pb_grpc
from splitserve_runtime.engine_option_rules import world_size
from splitserve_runtime.profiler_config import ProfilerConfig
from splitserve_runtime.termination import report_fatal
from splitserve_runtime.tls import peer_identity
from splitserve_runtime.tracing import Tracing
from worker_svc import convert
from worker_svc.cpu_binding import CpuBinding
from worker_svc.kv_connector.rank_connector import RankKvConnector
from worker_svc.lora.peft_config import AdapterNotFound
from worker_svc.metrics import WorkerMetrics
from worker_svc.model_loader.model_load import LoadedModel, LoadModelConfig, WorkerDescription
from worker_svc.ownership import (
    Claim,
    Ownership,
    OwnershipError,
    check_model_loadable,
    claim_from_metadata,
)
from worker_svc.scheduler_output import GrammarBitmask
from worker_svc.step_checks import MalformedStep
from worker_svc.stream.output_stream import StepOutputs
from worker_svc.stream.profiler import RankProfiler
from worker_svc.stream.request_stream import StepRequests
from worker_svc.stream.stall_watch import StallWatch
from worker_svc.stream.step_tracing import StepTraces
from worker_svc.worker import Worker, WorkerStateError

logger = logging.getLogger(__name__)

T = TypeVar("T")
WEDGED_AFTER_SECONDS = 30.0
"""LoadModel waits this long for a running step before it deems the rank wedged."""
WEDGED_EXIT_CODE = 75
"""Exit status of a rank that quits because it is wedged (EX_TEMPFAIL: restart me)."""


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    """Serves WorkerService for one rank.

    `device` is "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N";
    `rank_hint` picks the CUDA device under "auto" (rank % device count) before LoadModel
    says the real rank; `kv` is the rank's KV connector seam (worker_svc/kv_connector). Step metrics (worker_svc.metrics) are labelled by what LoadModel says.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        stall_watch: StallWatch,
        device: str = "auto",
        rank_hint: int = 0,
        profiler_config: ProfilerConfig | None = None,
        tracing: Tracing | None = None,
        cpu_binding: CpuBinding | None = None,
        kv: RankKvConnector | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._cpu_binding = cpu_binding or CpuBinding()
        self._traces = StepTraces(tracing)
        self._profiler_config = profiler_config or ProfilerConfig()
        self._profiler: RankProfiler | None = None
        self._worker = Worker(device, rank_hint, kv)
        self._metrics = WorkerMetrics(registry)
        self._stall_watch = stall_watch
        self._last_step_id = 0
        self._failure: str | None = None
        self._is_closed = False
        self._ownership = Ownership()
        self._description: WorkerDescription | None = None

    @property
    def worker(self) -> Worker:
        return self._worker

    def _call(
        self, context: grpc.ServicerContext, fn: Callable[..., T], *args: Any, alone: bool = True
    ) -> T:
        """Run `fn` (alone, unless told it may run beside a step), turning our exceptions into
        gRPC status codes."""
        try:
            with self._lock if alone else contextlib.nullcontext():
                return fn(*args)
        except OwnershipError as e:
            status, message = e.grpc_code, str(e)
        except WorkerStateError as e:
            status, message = grpc.StatusCode.FAILED_PRECONDITION, str(e)
        except AdapterNotFound as e:
            status, message = grpc.StatusCode.NOT_FOUND, str(e)
        except (ValueError, FileNotFoundError) as e:
            status, message = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except Exception as e:  # noqa: BLE001 (reported to the caller, logged here)
            logger.exception("worker call %s failed", getattr(fn, "__name__", fn))
            status, message = grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
        _abort(context, status, message)

    def Describe(
        self, request: pb.DescribeRequest, context: grpc.ServicerContext
    ) -> pb.DescribeResponse:
        """Answers at once, also while a step holds the rank (a bring-up must reach a rank that
        is stuck in a collective, to reload it): then with what it said last time."""
        if self._description is None or not self._lock.locked():
            self._description = self._call(context, self._worker.describe)
        return convert.description_to_proto(self._description)

    def LoadModel(
        self, request: pb.LoadModelRequest, context: grpc.ServicerContext
    ) -> pb.LoadModelResponse:
        try:
            config = convert.load_model_config_from_proto(request)
        except ValueError as e:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        claim = Claim(peer_identity(context), request.owner_epoch)
        if not self._lock.acquire(timeout=WEDGED_AFTER_SECONDS):
            # A step of the previous bring-up is stuck in a collective whose peer is gone; no
            # thread can get it out. Exit so the rank restarts clean and the new core can retry.
            report_fatal(
                "worker",
                f"a step has held this rank for {WEDGED_AFTER_SECONDS:.0f} s; exiting to restart "
                "clean",
            )
            os._exit(WEDGED_EXIT_CODE)
        self._lock.release()
        loaded = self._call(context, self._load_model, claim, config)
        self._metrics.bind(
            request.served_model_name or config.model_path, request.engine_id, config.rank
        )
        logger.info(  # vLLM's wording first: operators grep for it
            "Model loading took %.4f GiB and %.2f seconds (%s, %d layers, %s, attention %s)",
            loaded.weight_bytes / 2**30,
            loaded.load_seconds,
            loaded.architecture,
            loaded.num_layers,
            loaded.dtype,
            loaded.attention_backend,
        )
        return convert.loaded_model_to_proto(loaded)

    def _load_model(self, claim: Claim, config: LoadModelConfig) -> LoadedModel:
        """Ownership first; a loaded rank keeps its model unless the new one can load."""
        is_loaded = self._worker.runner is not None
        self._ownership.check_load(claim, is_loaded)
        if is_loaded:
            check_model_loadable(config.model_path, config.options.model.revision)
        # A (re)starting core's first step sets the count (a core that recovered from a rank
        # restart goes on counting where it was); later steps must follow one by one.
        self._last_step_id, self._failure = 0, None
        options = config.options
        logger.info(
            "loading %s as rank %d (tp=%d, pp=%d, dtype=%s%s)",
            config.model_path or "the default model",
            config.rank,
            options.parallel.tensor_parallel_size,
            options.parallel.pipeline_parallel_size,
            options.model.dtype,
            ", enforce_eager" if options.model.enforce_eager else "",
        )
        if self._worker.device.type == "cpu":  # vLLM-CPU's variable: GPU ranks stay unbound
            self._cpu_binding.apply(config.rank, world_size(options))
        loaded = self._worker.load_model(config)
        self._ownership.loaded_by(claim)
        return loaded

    def _claim(self, context: grpc.ServicerContext) -> Claim:
        """The caller's claim on this rank (after LoadModel: its epoch rides in metadata)."""
        try:
            return claim_from_metadata(peer_identity(context), context.invocation_metadata())
        except ValueError as e:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _as_owner(self, context: grpc.ServicerContext, fn: Callable[..., T], *args: Any) -> T:
        """`_call`, for the rank's owner only."""
        claim = self._claim(context)

        def owned(*fn_args: Any) -> T:
            self._ownership.check_call(claim)
            return fn(*fn_args)

        owned.__name__ = getattr(fn, "__name__", "call")
        return self._call(context, owned, *args)

    def GetKvCapacity(
        self, request: pb.GetKvCapacityRequest, context: grpc.ServicerContext
    ) -> pb.GetKvCapacityResponse:
        capacity = self._as_owner(
            context,
            self._worker.get_kv_capacity,
            request.gpu_memory_utilization,
            request.kv_cache_memory_bytes,
        )
        return convert.kv_capacity_to_proto(capacity)

    def InitializeKvCache(
        self, request: pb.InitializeKvCacheRequest, context: grpc.ServicerContext
    ) -> pb.InitializeKvCacheResponse:
        nbytes = self._as_owner(
            context, self._worker.initialize_kv_cache, request.num_blocks, request.num_state_slots
        )
        return pb.InitializeKvCacheResponse(kv_cache_bytes=nbytes)

    def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, context: grpc.ServicerContext
    ) -> pb.LoadLoraAdapterResponse:
        """Reads the files beside a running step (only caching the adapter waits for it)."""
        claim = self._claim(context)
        self._call(context, self._ownership.check_call, claim)
        worker = self._worker
        adapter = self._call(
            context, worker.read_lora_adapter, request.lora_id, request.lora_path, alone=False
        )
        self._as_owner(context, worker.keep_lora_adapter, adapter)
        logger.info(
            "LoRA adapter %d read from %s: rank %d, %s, %.1f MiB in %.3f s",
            adapter.lora_id,
            adapter.path,
            adapter.max_rank,
            ", ".join(adapter.target_modules),
            adapter.nbytes / 2**20,
            adapter.load_seconds,
        )
        return convert.lora_adapter_to_proto(adapter)

    def Execute(
        self, request_iterator: Iterator[pb.ExecuteRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ExecuteResponse]:
        claim = self._claim(context)
        self._call(context, self._ownership.check_call, claim)
        if not self._worker.is_kv_cache_ready:
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "Execute needs LoadModel and InitializeKvCache first",
            )
        outputs: StepOutputs[pb.ExecuteResponse] = StepOutputs(context.is_active)
        requests = StepRequests(request_iterator)
        try:
            outputs.run(lambda: self._step_loop(requests, context, claim, outputs), "steps")
            yield from outputs.drain()
        finally:
            requests.close()

    def _step_loop(
        self,
        request_iterator: Iterator[pb.ExecuteRequest],
        context: grpc.ServicerContext,
        claim: Claim,
        outputs: StepOutputs[pb.ExecuteResponse],
    ) -> None:
        """Run the stream's steps in order on this (the step) thread; hand each response to
        the RPC thread, which writes it while the next step runs (worker_svc/stream/output_stream.py)."""
        if self._worker.device.type == "cuda":
            torch.cuda.set_device(self._worker.device)  # the current device is per thread
        for request in request_iterator:
            if request.HasField("grammar_output"):
                continue  # the deferred masks of a step that sampled nothing on this rank
            if request.HasField("profile"):  # between two steps, on the step thread
                with self._lock:
                    self._rank_profiler().apply(request.profile.action, request.profile.prefix)
                continue
            with self._lock:
                if self._ownership.owner != claim:  # a newer core took this rank over
                    _abort(context, grpc.StatusCode.FAILED_PRECONDITION, "rank taken over")
                self._stall_watch.step_started()
                try:
                    response = self._execute_step(request, request_iterator)
                finally:
                    self._stall_watch.step_ended()
            if response is not None:
                outputs.put(response)

    def _rank_profiler(self) -> RankProfiler:
        if self._profiler is None:
            worker = self._worker
            self._profiler = RankProfiler(
                self._profiler_config, worker.parallel.rank, worker.device
            )
        return self._profiler

    def _execute_step(
        self, request: pb.ExecuteRequest, request_iterator: Iterator[pb.ExecuteRequest]
    ) -> pb.ExecuteResponse | None:
        """One step on the model thread; None when this rank has nothing to say. A step with
        has_pending_grammar reads its masks from the stream, before it samples."""
        received = time.perf_counter()
        step_id = request.scheduler_output.step_id
        rank = self._worker.parallel.rank
        if self._failure is None and self._last_step_id and step_id != self._last_step_id + 1:
            self._failure = (
                f"step {step_id} arrived after step {self._last_step_id}; steps must be consecutive"
            )
        if self._failure is not None:
            return _error_response(step_id, rank, f"rank {rank} has failed: {self._failure}")
        try:
            step = convert.scheduler_output_from_proto(request.scheduler_output)
            started = time.monotonic()
            output = self._worker.execute(step, lambda: _next_grammar(request_iterator, step_id))
        except (MalformedStep, OverflowError) as e:  # refused before any state changed
            self._last_step_id = step_id
            logger.warning("rank %d refused step %d: %s", rank, step_id, e)
            return _error_response(step_id, rank, f"rank {rank} refused step {step_id}: {e}")
        except Exception as e:  # noqa: BLE001 (every failure becomes a STEP_STATUS_ERROR)
            logger.exception("step %d failed on rank %d", step_id, rank)
            self._failure = f"step {step_id} failed: {type(e).__name__}: {e}"
            return _error_response(step_id, rank, f"rank {rank}: {self._failure}")
        self._last_step_id = step_id
        total_seconds = time.perf_counter() - received
        self._metrics.observe_step(
            output, request.scheduler_output.total_num_scheduled_tokens, total_seconds
        )
        if output is None:
            return None
        if output.timings is not None:  # not a non-output rank's transfers report
            output.timings.total_seconds = total_seconds
            self._traces.observe(step, rank, started, time.monotonic(), output.timings)
        return pb.ExecuteResponse(model_runner_output=convert.model_runner_output_to_proto(output))

    def close(self) -> None:
        """Release the model and the process group. Waits for a running step at most briefly:
        a step stuck in a collective (a peer rank died) must not hold shutdown."""
        if self._is_closed:
            return
        self._is_closed = True
        if not self._lock.acquire(timeout=30.0):
            logger.warning("a step is still running after 30 s; closing without releasing it")
            return
        try:
            self._worker.shutdown()
        finally:
            self._lock.release()

    shutdown = close


def _next_grammar(
    request_iterator: Iterator[pb.ExecuteRequest], step_id: int
) -> GrammarBitmask | None:
    """The deferred grammar masks of step `step_id`: the next message on the stream."""
    try:
        request = next(request_iterator)
    except StopIteration:
        raise RuntimeError(f"the stream closed before step {step_id}'s grammar masks") from None
    if not request.HasField("grammar_output") or request.grammar_output.step_id != step_id:
        raise RuntimeError(f"step {step_id} waited for its grammar masks and got another message")
    return convert.grammar_bitmask_from_proto(request.grammar_output.grammar_bitmask)


def _error_response(step_id: int, rank: int, message: str) -> pb.ExecuteResponse:
    return pb.ExecuteResponse(
        model_runner_output=convert.error_output_to_proto(step_id, rank, message)
    )


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("context.abort returned")  # grpc raises; keeps mypy informed
