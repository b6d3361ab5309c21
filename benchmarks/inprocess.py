"""The same engine with no internal gRPC hop: frontend, engine core and worker in one process.

Everything the services do still happens — input processing, the core's busy loop, scheduling,
the worker's step, output processing and detokenization, and each service's conversion to and
from the contract messages — but the messages are handed over as objects instead of being
serialised and sent over loopback gRPC. The public API is still served over gRPC
(`python -m benchmarks.inprocess --model PATH --port N`), so a benchmark client loads it exactly
as it loads a real stack, and the difference between the two is what the frontend<->core and
core<->worker hops cost.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from core_svc import convert as core_convert
from core_svc.engine_core import EngineCore
from core_svc.engine_loop import EngineCoreProc
from core_svc.outputs import EngineCoreOutputs, ModelRunnerOutput
from core_svc.scheduler_config import CacheConfig, SchedulerConfig
from core_svc.scheduler_output import SchedulerOutput
from frontend_svc import convert as frontend_convert
from frontend_svc.async_engine import AsyncEngine
from frontend_svc.core_client import CoreEvent
from frontend_svc.detokenizer import backend_decoder
from frontend_svc.engine_types import EngineInfo
from frontend_svc.input_processor import InputProcessor, load_tokenizer
from frontend_svc.metrics import FrontendMetrics
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.requests import EngineRequest
from splitserve_contracts.sampling_rules import Limits
from worker_svc import convert as worker_convert
from worker_svc.worker import LoadedModel, LoadModelConfig, Worker

CLIENT_ID = 1


class InProcessExecutor:
    """The core's Executor calling a Worker directly (the contract messages as objects)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        step = worker_convert.scheduler_output_from_proto(
            core_convert.scheduler_output_to_proto(scheduler_output)
        )
        output = self.worker.execute(step)
        assert output is not None, "a single rank is always the output rank"
        return core_convert.model_runner_output_from_proto(
            worker_convert.model_runner_output_to_proto(output)
        )

    def shutdown(self) -> None:
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

    def abort_requests(self, handles: list[int]) -> None:
        if handles:
            self.proc.abort_requests(CLIENT_ID, handles)

    async def close(self) -> None:
        return None


@dataclass
class InProcessEngine:
    """A running in-process engine (it lives as long as its process)."""

    engine: AsyncEngine
    inputs: InputProcessor
    info: EngineInfo


async def start_in_process(
    model: str,
    dtype: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_bytes: int,
    block_size: int = 16,
) -> InProcessEngine:
    """Load the model and start the core loop, as `splitserve up` would, in this process.

    torch's OpenMP thread teams belong to the thread that starts them, and a second team runs
    about 2x slower while the first one's thread lives; the worker service therefore keeps all
    model work on one thread. Here loading runs on a thread that exits before the busy-loop
    thread (which executes the steps) starts."""
    worker = Worker("cpu")
    box: list[tuple[LoadedModel, int]] = []

    def load() -> None:
        loaded = worker.load_model(
            LoadModelConfig(
                model,
                dtype=dtype,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                block_size=block_size,
            )
        )
        blocks = worker.get_kv_capacity(0.9, kv_cache_bytes).num_blocks
        worker.initialize_kv_cache(blocks)
        box.append((loaded, blocks))

    loader = threading.Thread(target=load, name="in-process-load")
    loader.start()
    loader.join()
    loaded, num_blocks = box[0]
    core = EngineCore(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, loaded.max_model_len),
        CacheConfig(num_blocks, block_size),
        InProcessExecutor(worker),
    )
    info = EngineInfo(
        "bench",
        model,
        loaded.max_model_len,
        loaded.vocab_size,
        block_size,
        num_blocks,
        1,
        1,
        loaded.dtype,
        max_num_seqs,
        max_num_batched_tokens,
        True,
        "0",
        0.0,
    )
    tokenizer = load_tokenizer(model)
    bridge = OutputBridge(asyncio.get_running_loop())
    proc = EngineCoreProc(
        core, bridge.deliver, on_stats=lambda stats, seconds: None, on_failed=lambda message: None
    )
    metrics = FrontendMetrics(CollectorRegistry(), info.served_model_name, "0", info.max_model_len)
    engine = AsyncEngine(
        InProcessCoreClient(proc, bridge),
        OutputProcessor(backend_decoder(tokenizer), metrics),
        metrics,
    )
    engine.start()
    proc.start()
    inputs = InputProcessor(tokenizer, loaded.max_model_len, Limits(loaded.vocab_size))
    return InProcessEngine(engine, inputs, info)


async def serve(
    model: str,
    port: int,
    dtype: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_bytes: int,
) -> None:
    """Serve GenerationService from an in-process engine on 127.0.0.1:port until killed."""
    import grpc

    from frontend_svc.server import GenerationServicer
    from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc

    engine = await start_in_process(
        model, dtype, max_num_seqs, max_num_batched_tokens, kv_cache_bytes
    )
    info = engine.info
    servicer = GenerationServicer(engine.engine, engine.inputs, info, info.served_model_name)
    server = grpc.aio.server()
    gen_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Serve the public API from an in-process engine.")
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    args = parser.parse_args(argv)
    asyncio.run(
        serve(
            args.model,
            args.port,
            args.dtype,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.kv_cache_memory_bytes,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
