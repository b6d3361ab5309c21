"""WorkerPool bring-up against fake worker ranks on loopback gRPC: a rank that fails LoadModel
cancels the others' (which would wait in the rendezvous for it), and every retry presents a
larger owner epoch (a rank loaded by the failed attempt refuses its epoch again)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from core_svc import worker_pool
from core_svc.config import CoreConfig
from core_svc.worker_pool import ModelFacts, WorkerBringUpError, WorkerPool
from splitserve_contracts.worker.v1 import worker_service_pb2 as pb
from splitserve_contracts.worker.v1 import worker_service_pb2_grpc as pb_grpc


class FakeRank(pb_grpc.WorkerServiceServicer):
    """Answers the bring-up; `loads` scripts each LoadModel: "ok", "fail" or "hang"."""

    def __init__(self, loads: list[str]) -> None:
        self.loads = loads
        self.epochs: list[int] = []
        self.cancelled = asyncio.Event()

    async def Describe(self, request: pb.DescribeRequest, context: object) -> pb.DescribeResponse:  # noqa: N802
        return pb.DescribeResponse(device_type="cpu")

    async def LoadModel(  # noqa: N802
        self, request: pb.LoadModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadModelResponse:
        self.epochs.append(request.owner_epoch)
        script = self.loads.pop(0) if self.loads else "ok"
        if script == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the rank exited")
        if script == "hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return pb.LoadModelResponse(architecture="Fake", vocab_size=100, max_model_len=64)

    async def GetKvCapacity(  # noqa: N802
        self, request: pb.GetKvCapacityRequest, context: object
    ) -> pb.GetKvCapacityResponse:
        return pb.GetKvCapacityResponse(num_blocks=32)

    async def InitializeKvCache(  # noqa: N802
        self, request: pb.InitializeKvCacheRequest, context: object
    ) -> pb.InitializeKvCacheResponse:
        return pb.InitializeKvCacheResponse(kv_cache_bytes=1024)


async def bring_up(ranks: list[FakeRank]) -> tuple[WorkerPool, ModelFacts]:
    servers, addrs = [], []
    for rank in ranks:
        server = grpc.aio.server()
        pb_grpc.add_WorkerServiceServicer_to_server(rank, server)
        addrs.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    config = CoreConfig.of(model="fake", worker_addrs=addrs, tensor_parallel_size=len(ranks),
                        block_size=4, worker_connect_timeout=60)  # fmt: skip
    pool = WorkerPool(addrs, owner_epoch=100)
    try:
        return pool, await asyncio.wait_for(pool.bring_up_with_retries(config, "f"), 30)
    finally:
        await pool.close()
        for server in servers:
            await server.stop(None)


def test_a_failed_load_cancels_the_others_and_the_retry_takes_a_larger_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_pool, "RETRY_DELAY_SECONDS", 0.05)
    ranks = [FakeRank(["hang"]), FakeRank(["fail"])]
    pool, facts = asyncio.run(bring_up(ranks))
    assert ranks[0].cancelled.is_set()  # not left waiting for a rank that is gone
    assert facts.num_kv_blocks == 32
    for rank in ranks:
        assert len(rank.epochs) == 2 and rank.epochs[1] > rank.epochs[0] == 100
    assert pool.owner_epoch == ranks[0].epochs[1]


def test_a_refused_load_is_not_retried() -> None:
    class Refusing(FakeRank):
        async def LoadModel(
            self, request: pb.LoadModelRequest, context: grpc.aio.ServicerContext
        ) -> pb.LoadModelResponse:  # noqa: N802, E501
            self.epochs.append(request.owner_epoch)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such model")
            raise AssertionError

    refusing = Refusing([])
    with pytest.raises(WorkerBringUpError, match="no such model") as err:
        asyncio.run(bring_up([FakeRank([]), refusing]))
    assert not err.value.is_retryable and refusing.epochs == [100]
