"""The same engine with no internal gRPC hop: frontend, engine core and worker in one process.

Everything the services do still happens — input processing, the core's busy loop, scheduling,
the worker's step, output processing and detokenization, and each service's conversion to and
from the contract messages — but the messages are handed over as objects instead of being
serialised and sent over loopback gRPC. The offline `LLM` API runs TP=1 on it; the hop benchmark
(benchmarks/inprocess.py) serves the public gRPC API from it, so the difference to a real stack
is what the frontend<->core and core<->worker hops cost.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from core_svc import convert as core_convert
from core_svc.engine_core import EngineCore
from core_svc.engine_loop import EngineCoreProc
from core_svc.outputs import EngineCoreOutputs, ModelRunnerOutput
from core_svc.scheduler_config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS_PER_RANK,
    DEFAULT_MAX_NUM_SEQS,
    CacheConfig,
    SchedulerConfig,
)
from core_svc.scheduler_output import SchedulerOutput
from frontend_svc import convert as frontend_convert
from frontend_svc.assembly import Frontend, build_frontend
from frontend_svc.core_client import CoreEvent
from frontend_svc.engine_types import EngineInfo
from frontend_svc.model_files import load_model_files
from frontend_svc.requests import EngineRequest
from worker_svc import convert as worker_convert
from worker_svc.model_load import LoadedModel, LoadModelConfig
from worker_svc.scheduler_output import SchedulerOutput as WorkerSchedulerOutput
from worker_svc.worker import Worker

logger = logging.getLogger(__name__)
CLIENT_ID = 1


def _log_failure(message: str) -> None:
    logger.error("the in-process engine failed: %s", message)


class InProcessExecutor:
    """The core's Executor calling a Worker directly (the contract messages as objects).
    Under async scheduling (`submit_model`) the steps run on one thread of their own, so the
    core schedules the next step while the worker runs the current one."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: deque[Future[ModelRunnerOutput]] = deque()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._run(self._to_worker(scheduler_output))

    @staticmethod
    def _to_worker(scheduler_output: SchedulerOutput) -> WorkerSchedulerOutput:
        return worker_convert.scheduler_output_from_proto(
            core_convert.scheduler_output_to_proto(scheduler_output)
        )

    def _run(self, step: WorkerSchedulerOutput) -> ModelRunnerOutput:
        output = self.worker.execute(step)
        assert output is not None, "a single rank is always the output rank"
        return core_convert.model_runner_output_from_proto(
            worker_convert.model_runner_output_to_proto(output)
        )

    def submit_model(self, scheduler_output: SchedulerOutput) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="in-process-step")
        step = self._to_worker(scheduler_output)
        self._in_flight.append(self._pool.submit(self._run, step))

    def collect_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._in_flight.popleft().result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.worker.shutdown()


class OutputBridge:
    """The core's output sink (busy-loop thread) feeding the frontend's event queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.events: asyncio.Queue[CoreEvent] = asyncio.Queue()

    def deliver(self, client_id: int, outputs: EngineCoreOutputs) -> None:
        msg = core_convert.engine_core_outputs_to_proto(outputs)
        self._loop.call_soon_threadsafe(
            self.events.put_nowait, frontend_convert.core_outputs_from_proto(msg)
        )


class InProcessCoreClient:
    """The frontend's CoreClient talking to an EngineCoreProc in the same process."""

    core_addr = "in-process"

    def __init__(self, proc: EngineCoreProc, bridge: OutputBridge) -> None:
        self.proc, self.bridge = proc, bridge
        self._handles = itertools.count(1)

    @property
    def is_connected(self) -> bool:
        return True

    def next_handle(self) -> int:
        return next(self._handles)

    async def next_event(self) -> CoreEvent:
        return await self.bridge.events.get()

    def event_done(self) -> None:
        self.bridge.events.task_done()

    def add_requests(self, requests: list[tuple[int, EngineRequest]]) -> None:
        now = time.monotonic()
        self.proc.add_requests(
            CLIENT_ID,
            [
                core_convert.request_from_proto(
                    frontend_convert.engine_request_to_proto(h, r), CLIENT_ID, now
                )
                for h, r in requests
            ],
        )

    def resubmit_requests(self, requests: list[tuple[int, EngineRequest]]) -> None:
        self.add_requests(requests)  # never disconnects: nothing is ever resubmitted

    def abort_requests(self, handles: list[int]) -> None:
        if handles:
            self.proc.abort_requests(CLIENT_ID, handles)

    async def close(self) -> None:
        return None


@dataclass(frozen=True)
class EngineOptions:
    """The engine's settings, named as `splitserve core`'s flags (vLLM's engine arguments)."""

    model: str
    dtype: str = "auto"
    max_model_len: int = 0
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS_PER_RANK
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int = 0
    seed: int = 0
    device: str = "auto"
    served_model_name: str = ""
    enforce_eager: bool = False
    async_scheduling: bool | None = None  # None: on where it can run (the core's default)
    enable_expert_parallel: bool = False
    """With tensor_parallel_size > 1 (LLM's spawned engine): split whole experts over the ranks."""

    @property
    def is_async_scheduling(self) -> bool:
        """The in-process engine has one stage, so async scheduling runs unless switched off."""
        return self.async_scheduling is not False


@dataclass
class InProcessEngine:
    """A running in-process engine: its frontend, and the core loop to stop."""

    frontend: Frontend
    proc: EngineCoreProc

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the core loop and release the worker (call after the engine's close())."""
        self.proc.stop(timeout)


def _load(options: EngineOptions) -> tuple[Worker, LoadedModel, int]:
    """Load the model and allocate the KV cache on a thread that exits before the busy loop
    starts: torch's OpenMP thread teams belong to the thread that starts them, and a second
    live team runs about 2x slower (the worker service keeps all model work on one thread)."""
    box: list[tuple[Worker, LoadedModel, int]] = []

    def load() -> None:
        worker = Worker(options.device)
        loaded = worker.load_model(
            LoadModelConfig(
                options.model,
                dtype=options.dtype,
                seed=options.seed,
                max_model_len=options.max_model_len,
                max_num_seqs=options.max_num_seqs,
                max_num_batched_tokens=options.max_num_batched_tokens,
                block_size=options.block_size,
                enforce_eager=options.enforce_eager,
                async_scheduling=options.is_async_scheduling,
            )
        )
        capacity = worker.get_kv_capacity(
            options.gpu_memory_utilization, options.kv_cache_memory_bytes
        )
        worker.initialize_kv_cache(capacity.num_blocks)
        box.append((worker, loaded, capacity.num_blocks))

    loader = threading.Thread(target=load, name="in-process-load")
    loader.start()
    loader.join()
    if not box:
        raise RuntimeError(f"loading {options.model} failed (see the log above)")
    return box[0]


def _engine_info(options: EngineOptions, loaded: LoadedModel, num_blocks: int) -> EngineInfo:
    name = options.served_model_name or os.path.basename(os.path.normpath(options.model))
    usable_tokens = (num_blocks - 1) * options.block_size  # block 0 is the null block
    return EngineInfo(
        served_model_name=name,
        model_path=options.model,
        max_model_len=loaded.max_model_len,
        vocab_size=loaded.vocab_size,
        block_size=options.block_size,
        num_kv_blocks=num_blocks,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        dtype=loaded.dtype,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        enable_prefix_caching=options.enable_prefix_caching,
        engine_id="0",
        max_concurrency=usable_tokens / loaded.max_model_len,
        max_tokens_per_mm_item=loaded.max_tokens_per_mm_item,
    )


async def start_in_process(
    options: EngineOptions, registry: CollectorRegistry | None = None
) -> InProcessEngine:
    """Load the model and start the core loop and the frontend's engine on the running loop,
    as `splitserve up` would, in this process."""
    worker, loaded, num_blocks = _load(options)
    info = _engine_info(options, loaded, num_blocks)
    core = EngineCore(
        SchedulerConfig(
            options.max_num_seqs,
            options.max_num_batched_tokens,
            info.max_model_len,
            async_scheduling=options.is_async_scheduling,
        ),
        CacheConfig(
            num_blocks,
            options.block_size,
            options.enable_prefix_caching,
            sliding_window=loaded.sliding_window,
        ),
        InProcessExecutor(worker),
    )
    bridge = OutputBridge(asyncio.get_running_loop())
    proc = EngineCoreProc(
        core, bridge.deliver, on_stats=lambda stats, seconds: None, on_failed=_log_failure
    )
    frontend = build_frontend(
        InProcessCoreClient(proc, bridge),
        info,
        load_model_files(options.model),
        registry or CollectorRegistry(),
        info.served_model_name,
    )
    frontend.engine.start()
    proc.start()
    return InProcessEngine(frontend, proc)
