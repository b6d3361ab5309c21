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
import dataclasses
import itertools
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
from core_svc.option_flags import option_flags
from core_svc.outputs import EngineCoreOutputs
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
from splitserve_runtime.engine_option_rules import engine_options, validate
from splitserve_runtime.kv_connector_names import kv_transfer_options
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


IN_PROCESS_SETTINGS = (
    "served_model_name",
    "device",
    "async_scheduling",
    "speculative_config",
    "kv_transfer_config",
)
"""`LLM`'s keyword arguments that are no engine option of their own (vLLM's names)."""
VLLM_NAMES = {"scheduling_policy": "policy"}
"""vLLM's engine arguments whose option is named otherwise (vLLM's SchedulerConfig.policy)."""
ENGINE_ARGS = frozenset(
    name
    for name, group in FIELD_GROUP.items()
    if group not in ("speculative", "kv_transfer", "lora")
) - {"model", "tensor_parallel_size", "pipeline_parallel_size"}
"""The engine options `LLM` takes by name (vLLM's engine arguments): every field of the
contract's groups but the model (its first argument), the parallel sizes (its own arguments),
the groups vLLM takes as a dict (speculative_config, kv_transfer_config) and LoRA (no adapter
can be loaded through `LLM`)."""


@dataclass(frozen=True)
class EngineSettings:
    """What `LLM(model, **kwargs)` configures: the engine options record (common.v1.EngineOptions,
    filled from vLLM's engine-argument names and checked by its rules) and the settings of the
    engine this process starts that no option holds."""

    options: options_types.EngineOptions
    served_model_name: str = ""
    device: str = "auto"
    """The in-process worker's device ("auto": the best there is)."""
    async_scheduling: bool | None = None
    """As given; None: on where it can run (the core's default). options holds what it means
    in-process (one pipeline stage: on unless switched off)."""
    speculative_config: dict[str, Any] | None = None
    """vLLM's speculative_config as given, e.g. {"method": "ngram", "num_speculative_tokens":
    4}; options.speculative is what the ranks get of it."""

    @classmethod
    def of(cls, model: str, **engine_args: Any) -> EngineSettings:
        """The settings of vLLM's engine arguments; TypeError naming an argument that is none
        (vLLM's behaviour), InvalidEngineOptions (a ValueError naming the field) for a value
        the rules refuse."""
        local = {name: engine_args.pop(name) for name in IN_PROCESS_SETTINGS if name in engine_args}
        engine_args = {VLLM_NAMES.get(name, name): value for name, value in engine_args.items()}
        for name in engine_args:
            if name not in ENGINE_ARGS:
                raise TypeError(f"LLM got an unexpected keyword argument {name!r}")
        kv_transfer = local.pop("kv_transfer_config", None)
        settings = cls(options_types.EngineOptions(), **local)
        options = engine_options(
            engine_args,
            model=model,
            async_scheduling=settings.async_scheduling is not False,
            speculative=settings.speculative,
            kv_transfer=kv_transfer_options(kv_transfer) if kv_transfer else None,
        )
        return dataclasses.replace(settings, options=validate(options))

    @property
    def model(self) -> str:
        return self.options.model.model

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The speculative config, checked (InvalidSpeculativeConfig says what is wrong)."""
        if not self.speculative_config:
            return None
        return speculative_config_from_dict(self.speculative_config)

    def core_config(self) -> CoreConfig:
        """The in-process engine core's options: these, on one rank that nothing restarts
        (a failed step fails the engine at once)."""
        return CoreConfig(
            options=self.options,
            served_model_name=self.served_model_name,
            speculative_config=self.speculative,
            max_recovery_seconds=0.0,
        )

    def core_flags(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> list[str]:
        """These settings as `splitserve core` flags, for an engine core of that many ranks
        (the model and the parallel sizes are the launcher's)."""
        world = tensor_parallel_size * pipeline_parallel_size
        scheduler = self.options.scheduler
        flags = option_flags(
            self.options,
            {
                "model.model": None,
                "scheduler.max_num_batched_tokens": scheduler.max_num_batched_tokens * world,
                "scheduler.async_scheduling": self.async_scheduling,
                "speculative": self.speculative_config or None,
            },
        )
        if self.served_model_name:
            flags += ["--served-model-name", self.served_model_name]
        return flags


@dataclass
class InProcessEngine:
    """A running in-process engine: its frontend, and the core loop to stop."""

    frontend: Frontend
    proc: EngineCoreProc

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the core loop and release the worker (call after the engine's close())."""
        self.proc.stop(timeout)


def _load(options: EngineSettings) -> tuple[Worker, ModelFacts]:
    """Load the model and allocate the KV cache on a thread that exits before the busy loop
    starts: torch's OpenMP thread teams belong to the thread that starts them, and a second
    live team runs about 2x slower (the worker service keeps all model work on one thread)."""
    box: list[tuple[Worker, ModelFacts]] = []

    def load() -> None:
        worker = Worker(options.device)
        loaded = worker.load_model(LoadModelConfig(options.options))
        cache = options.options.cache
        capacity = worker.get_kv_capacity(cache.gpu_memory_utilization, cache.kv_cache_memory_bytes)
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
    options: EngineSettings, registry: CollectorRegistry | None = None
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
