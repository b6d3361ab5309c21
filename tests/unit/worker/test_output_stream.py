"""Outputs written beside the step loop (worker_svc/stream/output_stream.py): in order, none lost,
bounded, the loop's end or failure behind its outputs; and over a real gRPC server, a rank runs
its next queued step while the previous output still waits to be written."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from prometheus_client import CollectorRegistry

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.worker.v1 import worker_service_pb2 as pb
from splitserve_contracts.worker.v1 import worker_service_pb2_grpc as pb_grpc
from splitserve_runtime.services import OWNER_EPOCH_METADATA_KEY
from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.load_requests import load_request
from tests.unit.worker.test_worker_server import open_stream, read_output, start_server
from worker_svc.server import WorkerServicer
from worker_svc.stream.output_stream import StepOutputs, StreamClosed
from worker_svc.stream.stall_watch import StallWatch

pytestmark = pytest.mark.timeout(120)


def test_outputs_arrive_in_order_none_lost_behind_a_slow_writer() -> None:
    outputs: StepOutputs[int] = StepOutputs(lambda: True, max_pending=3)

    def loop() -> None:
        for i in range(200):
            outputs.put(i)

    outputs.run(loop, "steps")
    received = []
    for item in outputs.drain():
        if item % 50 == 0:
            time.sleep(0.02)  # a slow write now and then
        received.append(item)
    assert received == list(range(200))


def test_a_loop_waits_for_room_rather_than_piling_up() -> None:
    outputs: StepOutputs[int] = StepOutputs(lambda: True, max_pending=2)
    num_put = 0

    def loop() -> None:
        nonlocal num_put
        for i in range(10):
            outputs.put(i)
            num_put += 1

    outputs.run(loop, "steps")
    time.sleep(0.3)
    assert num_put == 2  # nothing drained yet: the third put waits
    assert list(outputs.drain()) == list(range(10))


def test_the_loop_failure_ends_the_stream_after_its_outputs() -> None:
    outputs: StepOutputs[str] = StepOutputs(lambda: True)

    def loop() -> None:
        outputs.put("a")
        outputs.put("b")
        raise RuntimeError("rank taken over")

    outputs.run(loop, "steps")
    drained = outputs.drain()
    assert [next(drained), next(drained)] == ["a", "b"]
    with pytest.raises(RuntimeError, match="rank taken over"):
        next(drained)


def test_a_stream_no_longer_drained_stops_the_loop_visibly() -> None:
    is_active = threading.Event()
    is_active.set()
    outputs: StepOutputs[int] = StepOutputs(is_active.is_set, max_pending=1)
    failure: list[BaseException] = []

    def loop() -> None:
        try:
            for i in range(10):
                outputs.put(i)
        except StreamClosed as e:
            failure.append(e)
            raise

    thread = outputs.run(loop, "steps")
    drained = outputs.drain()
    assert next(drained) == 0
    is_active.clear()  # the RPC was cancelled: gRPC stops draining
    thread.join(timeout=5)
    assert not thread.is_alive() and len(failure) == 1


def new_request_step(step_id: int, handle: int) -> pb.ExecuteRequest:
    new = pb.NewRequestData(
        req_handle=handle,
        request_id=f"r{handle}",
        prompt_token_ids=[7, 8, 9],
        block_ids=[handle],
        sampler_params=types_pb2.SamplerParams(temperature=0.0),
    )
    return pb.ExecuteRequest(
        scheduler_output=pb.SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=[new],
            num_scheduled_tokens=[3],
            total_num_scheduled_tokens=3,
        )
    )


class SlowWriter(WorkerServicer):
    """Hands each output to gRPC only once the rank ran the step after it (at most 10 s): what
    a write that takes longer than a step looks like to the step loop."""

    ran_ahead: list[bool]

    def Execute(
        self, request_iterator: Iterator[pb.ExecuteRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ExecuteResponse]:
        self.ran_ahead = []
        for response in super().Execute(request_iterator, context):
            step_id = response.model_runner_output.step_id
            deadline = time.monotonic() + 10.0
            while self._last_step_id <= step_id and time.monotonic() < deadline:
                time.sleep(0.005)
            self.ran_ahead.append(self._last_step_id > step_id)
            yield response


async def steps_behind_slow_writes(servicer: SlowWriter, port: int) -> list[int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = cast("pb_grpc.WorkerServiceAsyncStub", pb_grpc.WorkerServiceStub(channel))
        call = open_stream(stub)
        for step_id in range(1, 5):  # queued ahead, as the core does under async scheduling
            await call.write(new_request_step(step_id, handle=step_id))
        step_ids = []
        for _ in range(3):
            out = await read_output(call)
            assert out.status == pb.STEP_STATUS_OK, out.error_message
            step_ids.append(out.step_id)
        await call.done_writing()
        step_ids += [(await read_output(call)).step_id]
        return step_ids


def test_the_next_step_runs_while_the_previous_output_is_written(
    worker_checkpoints: CheckpointCache,
) -> None:
    model = worker_checkpoints.get("llama")
    servicer = SlowWriter(CollectorRegistry(), StallWatch(lambda is_ready: None), device="cpu")
    server, port = start_server(servicer)
    try:

        async def bring_up() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = cast("pb_grpc.WorkerServiceAsyncStub", pb_grpc.WorkerServiceStub(channel))
                await stub.LoadModel(load_request(model_path=str(model), block_size=4))
                await stub.InitializeKvCache(pb.InitializeKvCacheRequest(num_blocks=16))

        asyncio.run(bring_up())
        assert asyncio.run(steps_behind_slow_writes(servicer, port)) == [1, 2, 3, 4]
        # Steps 1-3 each ran the next step before their write; step 4 had none after it.
        assert servicer.ran_ahead == [True, True, True, False]
    finally:
        servicer.close()
        server.stop(None)


async def taken_over_mid_stream(model: Path, port: int) -> tuple[list[int], grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = cast("pb_grpc.WorkerServiceAsyncStub", pb_grpc.WorkerServiceStub(channel))
        await stub.LoadModel(load_request(model_path=str(model), block_size=4, owner_epoch=1))
        await stub.InitializeKvCache(
            pb.InitializeKvCacheRequest(num_blocks=16), metadata=((OWNER_EPOCH_METADATA_KEY, "1"),)
        )
        execute: Any = stub.Execute
        call = execute(metadata=((OWNER_EPOCH_METADATA_KEY, "1"),))
        for step_id in (1, 2):
            await call.write(new_request_step(step_id, handle=step_id))
        step_ids = [(await read_output(call)).step_id, (await read_output(call)).step_id]
        await stub.LoadModel(  # a restarted core (a larger epoch) takes the rank over
            load_request(model_path=str(model), block_size=4, owner_epoch=2)
        )
        await call.write(new_request_step(3, handle=3))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call.read()
        return step_ids, failed.value.code(), str(failed.value.details())


def test_a_rank_taken_over_mid_stream_fails_the_stream_after_its_outputs(
    worker_checkpoints: CheckpointCache,
) -> None:
    model = worker_checkpoints.get("llama")
    servicer = WorkerServicer(CollectorRegistry(), StallWatch(lambda is_ready: None), device="cpu")
    server, port = start_server(servicer)
    try:
        step_ids, code, details = asyncio.run(taken_over_mid_stream(model, port))
    finally:
        servicer.close()
        server.stop(None)
    assert step_ids == [1, 2]
    assert code == grpc.StatusCode.FAILED_PRECONDITION and details == "rank taken over"
