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
import json
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from core_svc import convert as core_convert
from core_svc.assembly import build_engine, served_model_name
from core_svc.config import CoreConfig
from core_svc.engine.engine_inbox import EngineInbox
from core_svc.engine.engine_loop import EngineCoreProc
from core_svc.kv_cache.kv_events import KVEventBatch
from core_svc.outputs import EngineCoreOutputs
from core_svc.sched.scheduler_config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS_PER_RANK,
    DEFAULT_MAX_NUM_SEQS,
)
from core_svc.sched.scheduler_output import SchedulerOutput
from core_svc.worker_pool import ModelFacts
from frontend_svc import convert as frontend_convert
from frontend_svc.assembly import Frontend, build_frontend
from frontend_svc.engine.core_client import CoreEvent
from frontend_svc.inputs.model_files import load_model_files
from frontend_svc.requests import EngineRequest
from splitserve_contracts import engine_options_types as options_types
from splitserve_contracts.engine_options_types import FIELD_GROUP
from splitserve_contracts.output_types import ModelRunnerOutput
from splitserve_contracts.spec_decode import SpeculativeConfig, speculative_config_from_dict
from splitserve_runtime.engine_option_rules import engine_options
from worker_svc import convert as worker_convert
from worker_svc.model_loader.model_load import LoadedModel, LoadModelConfig
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
        if scheduler_output.has_pending_grammar:  # runs when its masks come (submit_grammar)
            self._in_flight.append(Future())
            return
        step = self._to_worker(scheduler_output)
        self._in_flight.append(self._pool.submit(self._run, step))

    def submit_grammar(self, scheduler_output: SchedulerOutput) -> None:
        """Run the newest step, submitted with has_pending_grammar, now that it has its masks."""
        assert self._pool is not None
        scheduler_output.has_pending_grammar = False
        waiting = self._in_flight[-1]
        done = self._pool.submit(self._run, self._to_worker(scheduler_output))
        done.add_done_callback(lambda f: _settle(waiting, f))

    def collect_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._in_flight.popleft().result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.worker.shutdown()


def _settle(target: Future[ModelRunnerOutput], source: Future[ModelRunnerOutput]) -> None:
    error = source.exception()
    if error is None:
        target.set_result(source.result())
    else:
        target.set_exception(error)


class OutputBridge:
    """The core's output sink (busy-loop thread) feeding the frontend's event queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.events: asyncio.Queue[CoreEvent] = asyncio.Queue()

    def deliver(self, client_id: int, outputs: EngineCoreOutputs | KVEventBatch) -> None:
        if isinstance(outputs, KVEventBatch):
            return  # never subscribed: the offline API serves no gateway
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
        self.proc.inbox.add_requests(
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
            self.proc.inbox.abort_requests(CLIENT_ID, handles)

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
    quantization: str = ""
    """vLLM's quantization ("": the checkpoint's own; int8, int4, w8a8: quantize at load)."""
    dequantize_gguf: bool = False
    kv_cache_dtype: str = "auto"
    """vLLM's kv_cache_dtype: auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2."""
    speculative_config: dict[str, Any] | None = None
    """vLLM's speculative_config, e.g. {"method": "ngram", "num_speculative_tokens": 4}."""

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The speculative config, checked (InvalidSpeculativeConfig says what is wrong)."""
        if not self.speculative_config:
            return None
        return speculative_config_from_dict(self.speculative_config)

    @property
    def is_async_scheduling(self) -> bool:
        """The in-process engine has one pipeline stage, so async scheduling runs unless
        switched off."""
        return self.async_scheduling is not False

    def core_config(self) -> CoreConfig:
        """The in-process engine core's options: these, on one rank that nothing restarts
        (a failed step fails the engine at once)."""
        return CoreConfig(
            options=self.engine_options(),
            served_model_name=self.served_model_name,
            enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            speculative_config=self.speculative,
            max_recovery_seconds=0.0,
        )

    def engine_options(self) -> options_types.EngineOptions:
        """These settings as the engine options record (those named alike, by name)."""
        named = {name: getattr(self, name) for name in FIELD_GROUP if hasattr(self, name)}
        named |= {"async_scheduling": self.is_async_scheduling, "speculative": self.speculative}
        return engine_options(named)

    def core_flags(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> list[str]:
        """These options as `splitserve core` flags, for an engine core of that many ranks."""
        world = tensor_parallel_size * pipeline_parallel_size
        values = {
            "--dtype": self.dtype,
            "--max-model-len": self.max_model_len,
            "--max-num-seqs": self.max_num_seqs,
            "--max-num-batched-tokens": self.max_num_batched_tokens * world,
            "--block-size": self.block_size,
            "--gpu-memory-utilization": self.gpu_memory_utilization,
            "--kv-cache-memory-bytes": self.kv_cache_memory_bytes,
            "--seed": self.seed,
            "--served-model-name": self.served_model_name,
            "--quantization": self.quantization,
            "--kv-cache-dtype": self.kv_cache_dtype,
        }
        flags = [str(x) for k, v in values.items() if v not in ("", None) for x in (k, v)]
        if not self.enable_prefix_caching:
            flags.append("--no-enable-prefix-caching")
        if self.enforce_eager:
            flags.append("--enforce-eager")
        if self.dequantize_gguf:
            flags.append("--dequantize-gguf")
        if self.enable_expert_parallel:
            flags.append("--enable-expert-parallel")
        if self.async_scheduling is not None:  # else the core's default (on where it can run)
            flags.append("--async-scheduling" if self.async_scheduling else "--no-async-scheduling")
        if self.speculative_config:
            flags += ["--speculative-config", json.dumps(self.speculative_config)]
        return flags


@dataclass
class InProcessEngine:
    """A running in-process engine: its frontend, and the core loop to stop."""

    frontend: Frontend
    proc: EngineCoreProc

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the core loop and release the worker (call after the engine's close())."""
        self.proc.stop(timeout)


def _load(options: EngineOptions) -> tuple[Worker, ModelFacts]:
    """Load the model and allocate the KV cache on a thread that exits before the busy loop
    starts: torch's OpenMP thread teams belong to the thread that starts them, and a second
    live team runs about 2x slower (the worker service keeps all model work on one thread)."""
    box: list[tuple[Worker, ModelFacts]] = []

    def load() -> None:
        worker = Worker(options.device)
        loaded = worker.load_model(LoadModelConfig(options.engine_options()))
        capacity = worker.get_kv_capacity(
            options.gpu_memory_utilization, options.kv_cache_memory_bytes
        )
        kv_bytes = worker.initialize_kv_cache(capacity.num_blocks)
        box.append((worker, _facts(loaded, capacity.num_blocks, kv_bytes, worker.device.type)))

    loader = threading.Thread(target=load, name="in-process-load")
    loader.start()
    loader.join()
    if not box:
        raise RuntimeError(f"loading {options.model} failed (see the log above)")
    return box[0]


def _facts(loaded: LoadedModel, num_blocks: int, kv_bytes: int, device_type: str) -> ModelFacts:
    """What the one rank reports, as the core's bring-up gathers it from every rank."""
    return ModelFacts(
        loaded.architecture,
        loaded.vocab_size,
        loaded.max_model_len,
        loaded.dtype,
        loaded.attention_backend,
        num_blocks,
        kv_bytes,
        sliding_window=loaded.sliding_window,
        device_type=device_type,
        max_tokens_per_mm_item=loaded.max_tokens_per_mm_item,
    )


async def start_in_process(
    options: EngineOptions, registry: CollectorRegistry | None = None
) -> InProcessEngine:
    """Load the model and start the core loop and the frontend's engine on the running loop,
    as `splitserve up` would, in this process."""
    worker, facts = _load(options)
    config = options.core_config()
    inbox = EngineInbox()
    core = build_engine(config, facts, InProcessExecutor(worker), inbox)
    info = frontend_convert.engine_info_from_proto(
        core_convert.engine_info_to_proto(config, facts, served_model_name(config))
    )
    bridge = OutputBridge(asyncio.get_running_loop())
    proc = EngineCoreProc(
        core,
        inbox,
        bridge.deliver,
        on_stats=lambda stats, seconds: None,
        on_failed=_log_failure,
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
