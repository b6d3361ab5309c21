"""GrpcExecutor: broadcast each SchedulerOutput to every worker rank over its Execute stream and
take the ModelRunnerOutput from the output rank.

`execute_model` runs on the engine's busy-loop thread: it serialises the step once, hands the
bytes to the event loop (which writes them to every rank's stream) and blocks until the output
rank answers. Reader tasks watch every rank: an error reply, a closed stream or a broken
connection on ANY rank fails the executor at once (the pending step raises ExecutorError and
`on_failure` tells the server to turn readiness off) instead of waiting for a timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable

import grpc

from core_svc import convert
from core_svc.executor import ExecutorError
from core_svc.outputs import ModelRunnerOutput
from core_svc.scheduler_output import SchedulerOutput
from splitserve.worker.v1 import worker_service_pb2 as worker_pb2

logger = logging.getLogger(__name__)
EXECUTE_METHOD = "/splitserve.worker.v1.WorkerService/Execute"


def _frame_execute_request(scheduler_output: bytes) -> bytes:
    """Serialised ExecuteRequest holding an already serialised SchedulerOutput (field 1,
    length-delimited), so the step is encoded once without copying a message."""
    size = len(scheduler_output)
    varint = bytearray()
    while True:
        byte = size & 0x7F
        size >>= 7
        varint.append(byte | (0x80 if size else 0))
        if not size:
            break
    return b"\x0a" + bytes(varint) + scheduler_output


def _identity(payload: bytes) -> bytes:
    return payload


class GrpcExecutor:
    """Executor over gRPC; see the module docstring."""

    def __init__(self, loop: asyncio.AbstractEventLoop, channels: list[grpc.aio.Channel],
                 addrs: list[str], output_rank: int, execute_timeout: float,
                 on_failure: Callable[[str], None],
                 on_timing: Callable[[float, float], None] | None = None) -> None:
        self._loop = loop
        self._on_timing = on_timing
        self._channels = channels
        self._addrs = addrs
        self.output_rank = output_rank
        self.execute_timeout = execute_timeout
        self._on_failure = on_failure
        self._calls: list[grpc.aio.StreamStreamCall] = []
        self._outboxes: list[asyncio.Queue[bytes]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: concurrent.futures.Future[worker_pb2.ModelRunnerOutput] | None = None
        self.failure: str | None = None

    async def open(self) -> None:
        """Open one Execute stream per rank (call on the event loop)."""
        for rank, channel in enumerate(self._channels):
            method = channel.stream_stream(
                EXECUTE_METHOD, request_serializer=_identity,
                response_deserializer=worker_pb2.ExecuteResponse.FromString)
            call = method()
            outbox: asyncio.Queue[bytes] = asyncio.Queue()
            self._calls.append(call)
            self._outboxes.append(outbox)
            self._tasks.append(asyncio.create_task(self._write(rank, call, outbox)))
            self._tasks.append(asyncio.create_task(self._read(rank, call)))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank (busy-loop thread); raise ExecutorError on any failure."""
        if self.failure is not None:
            raise ExecutorError(self.failure)
        body = convert.scheduler_output_to_proto(scheduler_output).SerializeToString()
        pending: concurrent.futures.Future[worker_pb2.ModelRunnerOutput] = (
            concurrent.futures.Future())
        self._pending = pending
        sent = time.perf_counter()
        self._loop.call_soon_threadsafe(self._broadcast, _frame_execute_request(body))
        try:
            reply = pending.result(timeout=self.execute_timeout)
        except concurrent.futures.TimeoutError:
            message = (f"step {scheduler_output.step_id} got no answer from worker rank "
                       f"{self.output_rank} within {self.execute_timeout:.0f} s")
            self._loop.call_soon_threadsafe(self._fail, message)
            raise ExecutorError(message) from None
        except ExecutorError:
            raise
        if self._on_timing is not None:
            self._on_timing(time.perf_counter() - sent, reply.timings.total_seconds)
        if reply.step_id != scheduler_output.step_id:
            raise ExecutorError(f"worker rank {self.output_rank} answered step {reply.step_id} "
                                f"to step {scheduler_output.step_id}")
        return convert.model_runner_output_from_proto(reply)

    def _broadcast(self, payload: bytes) -> None:
        for outbox in self._outboxes:
            outbox.put_nowait(payload)

    async def _write(self, rank: int, call: grpc.aio.StreamStreamCall,
                     outbox: asyncio.Queue[bytes]) -> None:
        try:
            while True:
                await call.write(await outbox.get())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken stream: the reader reports the cause too
            self._fail(f"worker rank {rank} ({self._addrs[rank]}): cannot send: {exc!r}")

    async def _read(self, rank: int, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    self._fail(f"worker rank {rank} ({self._addrs[rank]}) closed its stream")
                    return
                out = reply.model_runner_output
                if out.status == worker_pb2.STEP_STATUS_ERROR:
                    self._fail(f"worker rank {rank} ({self._addrs[rank]}) failed step "
                               f"{out.step_id}: {out.error_message}")
                    return
                pending = self._pending
                if rank == self.output_rank and pending is not None and not pending.done():
                    pending.set_result(out)
        except grpc.RpcError as err:
            self._fail(f"worker rank {rank} ({self._addrs[rank]}) is unreachable: "
                       f"{err.code().name}: {err.details()}")
        except asyncio.CancelledError:
            raise

    def _fail(self, message: str) -> None:
        """First failure wins: fail the pending step and report once (event-loop thread)."""
        if self.failure is not None:
            return
        self.failure = message
        logger.error("executor failed: %s", message)
        pending = self._pending
        if pending is not None and not pending.done():
            pending.set_exception(ExecutorError(message))
        self._on_failure(message)

    def shutdown(self) -> None:
        """Close the streams (any thread)."""
        self._loop.call_soon_threadsafe(self._close)

    def _close(self) -> None:
        self.failure = self.failure or "the executor was shut down"
        for task in self._tasks:
            task.cancel()
        for call in self._calls:
            call.cancel()
