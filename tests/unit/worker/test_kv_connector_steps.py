"""The GrpcConnector in the rank's step path: two WorkerServicers (the tiny model on CPU) on
loopback, one producer and one consumer. The producer prefills a prompt, its next step leases
the blocks; the consumer's steps with no scheduled tokens carry the load and report it; the
consumer then decodes from the loaded KV and samples what the producer sampled."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import grpc
import pytest
from prometheus_client import CollectorRegistry

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.kv.v1 import kv_transfer_pb2 as kv_pb
from splitserve_contracts.worker.v1 import worker_service_pb2 as pb
from splitserve_contracts.worker.v1 import worker_service_pb2_grpc as pb_grpc
from splitserve_runtime.sync_service_host import ThreadPerRpcExecutor
from tests.fixtures.checkpoints import CheckpointCache
from tests.fixtures.load_requests import load_request
from worker_svc.server import WorkerServicer
from worker_svc.stream.stall_watch import StallWatch

pytestmark = pytest.mark.timeout(120)

PROMPT = [7, 8, 9, 10, 11]
TRANSFER = "0f" * 16


def step(step_id: int, meta: kv_pb.GrpcConnectorMetadata | None = None, **fields: Any) -> Any:
    meta_bytes = b"" if meta is None else meta.SerializeToString()
    out = pb.SchedulerOutput(step_id=step_id, kv_connector_metadata=meta_bytes, **fields)
    return pb.ExecuteRequest(scheduler_output=out)


def prefill(step_id: int, handle: int, blocks: list[int], num_computed: int) -> Any:
    new = pb.NewRequestData(
        req_handle=handle,
        request_id=f"r{handle}",
        prompt_token_ids=PROMPT,
        block_ids=blocks,
        num_computed_tokens=num_computed,
        sampler_params=types_pb2.SamplerParams(temperature=0.0),
    )
    num_tokens = len(PROMPT) - num_computed
    return step(
        step_id,
        scheduled_new_reqs=[new],
        num_scheduled_tokens=[num_tokens],
        total_num_scheduled_tokens=num_tokens,
    )


class Rank:
    """A WorkerServicer on a loopback port, its KV slot added as main.py adds it."""

    def __init__(self) -> None:
        self.servicer = WorkerServicer(
            CollectorRegistry(), StallWatch(lambda is_ready: None), device="cpu"
        )
        self.server = grpc.server(ThreadPerRpcExecutor())
        pb_grpc.add_WorkerServiceServicer_to_server(self.servicer, self.server)
        self.server.add_generic_rpc_handlers((self.servicer.worker.kv.services,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()
        self.channel = grpc.aio.insecure_channel(self.address)
        stub = pb_grpc.WorkerServiceStub(self.channel)
        self.stub = cast("pb_grpc.WorkerServiceAsyncStub", stub)
        self.call: Any = None

    async def load(self, model: str, role: str, engine_id: str) -> None:
        request = load_request(
            model, block_size=4, kv_connector="GrpcConnector", kv_role=role, kv_engine_id=engine_id
        )
        await self.stub.LoadModel(request)
        await self.stub.InitializeKvCache(pb.InitializeKvCacheRequest(num_blocks=16))
        execute: Any = self.stub.Execute
        self.call = execute()

    async def run(self, request: Any) -> pb.ModelRunnerOutput:
        await self.call.write(request)
        response = await self.call.read()
        out = response.model_runner_output
        assert out.status == pb.STEP_STATUS_OK, out.error_message
        return cast("pb.ModelRunnerOutput", out)

    def layers(self, block_ids: list[int]) -> list[bytes]:
        runner = self.servicer.worker.runner
        assert runner is not None and runner.kv_cache is not None
        return [layer[:, block_ids].numpy().tobytes() for layer in runner.kv_cache.layers]

    async def stop(self) -> None:
        if self.call is not None:
            await self.call.done_writing()
        await self.channel.close()
        self.servicer.close()
        self.server.stop(None)


async def scenario(model: str) -> None:
    producer, consumer = Rank(), Rank()
    try:
        await producer.load(model, "kv_producer", "prod")
        await consumer.load(model, "kv_consumer", "cons")
        first = await producer.run(prefill(1, 5, [1, 2], 0))
        leased = kv_pb.GrpcConnectorMetadata(
            sends=[kv_pb.KvSend(req_handle=5, transfer_id=TRANSFER, block_ids=[1, 2])]
        )
        out = await producer.run(step(2, leased, finished_req_handles=[5]))
        assert not out.HasField("kv_connector_output") and not out.req_handles
        load = kv_pb.KvLoad(
            req_handle=9,
            local_block_ids=[3, 4],
            remote_block_ids=[1, 2],
            transfer_id=TRANSFER,
            remote_engine_id="prod",
            remote_addresses=[producer.address],
        )
        out = await consumer.run(step(1, kv_pb.GrpcConnectorMetadata(loads=[load])))
        step_id, deadline = 1, time.monotonic() + 10
        while not out.HasField("kv_connector_output"):  # empty steps, as the core polls
            assert time.monotonic() < deadline
            step_id += 1
            out = await consumer.run(step(step_id))
        report = out.kv_connector_output
        assert list(report.finished_recving) == [9], report
        assert report.num_bytes_received > 0 and not report.failed_recving
        assert consumer.layers([3, 4]) == producer.layers([1, 2])
        sent = await producer.run(step(3))
        assert list(sent.kv_connector_output.finished_sending) == [5]
        # vLLM recomputes the last prompt token from the loaded KV: same greedy token.
        decoded = await consumer.run(prefill(step_id + 1, 9, [3, 4], len(PROMPT) - 1))
        assert list(decoded.sampled_token_ids) == list(first.sampled_token_ids)
    finally:
        await producer.stop()
        await consumer.stop()


def test_a_load_rides_empty_steps_and_the_consumer_decodes_from_it(
    worker_checkpoints: CheckpointCache,
) -> None:
    asyncio.run(scenario(str(worker_checkpoints.get("llama"))))
