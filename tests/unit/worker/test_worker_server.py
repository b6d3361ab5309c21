"""WorkerServicer over a real (synchronous) gRPC server on a loopback ephemeral port, driven by a
grpc.aio client as the engine core would."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from prometheus_client import CollectorRegistry

from splitserve_contracts.common.v1 import types_pb2
from splitserve_contracts.worker.v1 import worker_service_pb2 as pb
from splitserve_contracts.worker.v1 import worker_service_pb2_grpc as pb_grpc
from splitserve_runtime.sync_service_host import ThreadPerRpcExecutor
from tests.fixtures.checkpoints import CheckpointCache, load_reference
from tests.fixtures.load_requests import load_request
from tests.fixtures.parity import reference_generate
from worker_svc.server import WorkerServicer
from worker_svc.stream.stall_watch import StallWatch

pytestmark = pytest.mark.timeout(120)

PROMPT = [7, 8, 9, 10, 11]
BLOCK_SIZE = 4


def first_step(step_id: int = 1) -> pb.ExecuteRequest:
    new = pb.NewRequestData(
        req_handle=5,
        request_id="r5",
        prompt_token_ids=PROMPT,
        block_ids=[1, 2],
        sampler_params=types_pb2.SamplerParams(temperature=0.0, logprobs=2, prompt_logprobs=1),
    )
    return pb.ExecuteRequest(
        scheduler_output=pb.SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=[new],
            num_scheduled_tokens=[5],
            total_num_scheduled_tokens=5,
        )
    )


def decode_step(step_id: int, token: int, num_computed: int) -> pb.ExecuteRequest:
    cached = pb.CachedRequestData(
        req_handles=[5],
        num_computed_tokens=[num_computed],
        num_new_block_ids=[0],
        num_new_token_ids=[1],
        new_token_ids=[token],
    )
    return pb.ExecuteRequest(
        scheduler_output=pb.SchedulerOutput(
            step_id=step_id,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=[1],
            total_num_scheduled_tokens=1,
        )
    )


def open_stream(stub: pb_grpc.WorkerServiceAsyncStub) -> Any:
    """The Execute stream (grpc-stubs types its call as needing a request iterator)."""
    execute: Any = stub.Execute
    return execute()


async def read_output(call: Any) -> pb.ModelRunnerOutput:
    response = await call.read()
    assert isinstance(response, pb.ExecuteResponse)
    return response.model_runner_output


async def expect_code(call: object, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code, info.value.details()
    return str(info.value.details())


def start_server(servicer: WorkerServicer) -> tuple[grpc.Server, int]:
    server = grpc.server(ThreadPerRpcExecutor())
    pb_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


async def scenario(model: Path, registry: CollectorRegistry) -> list[int]:
    servicer = WorkerServicer(registry, StallWatch(lambda is_ready: None), device="cpu")
    server, port = start_server(servicer)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cast("pb_grpc.WorkerServiceAsyncStub", pb_grpc.WorkerServiceStub(channel))
            described = await stub.Describe(pb.DescribeRequest())
            assert described.device_type == "cpu" and "torch" in described.attention_backends
            await expect_code(
                stub.GetKvCapacity(pb.GetKvCapacityRequest()),
                grpc.StatusCode.FAILED_PRECONDITION,
            )
            early = open_stream(stub)
            with contextlib.suppress(grpc.aio.AioRpcError):  # the rank may refuse before the write
                await early.write(first_step())
            await expect_code(early.read(), grpc.StatusCode.FAILED_PRECONDITION)
            details = await expect_code(
                stub.LoadModel(load_request(model_path=str(model), dtype="float8", block_size=4)),
                grpc.StatusCode.INVALID_ARGUMENT,
            )
            assert "float8" in details
            loaded = await stub.LoadModel(
                load_request(
                    model_path=str(model), served_model_name="tiny", engine_id="e0", block_size=4
                )
            )
            assert (loaded.architecture, loaded.dtype, loaded.num_layers) == (
                "LlamaForCausalLM",
                "float32",
                2,
            )
            # The same core (epoch) may not reload a loaded rank; a restarted core presents a
            # larger epoch and takes it over (tests/security/test_ownership.py).
            await expect_code(
                stub.LoadModel(load_request(model_path=str(model), engine_id="e0", block_size=4)),
                grpc.StatusCode.FAILED_PRECONDITION,
            )
            capacity = await stub.GetKvCapacity(
                pb.GetKvCapacityRequest(kv_cache_memory_bytes=1 << 20)
            )
            assert capacity.num_blocks == (1 << 20) // capacity.bytes_per_block  # null included
            await stub.InitializeKvCache(pb.InitializeKvCacheRequest(num_blocks=16))
            return await run_steps(stub)
    finally:
        servicer.close()
        server.stop(None)


async def run_steps(stub: pb_grpc.WorkerServiceAsyncStub) -> list[int]:
    call = open_stream(stub)
    await call.write(first_step())
    out = await read_output(call)
    assert out.status == pb.STEP_STATUS_OK and out.step_id == 1
    assert list(out.req_handles) == [5] and out.num_used_kv_blocks == 2
    assert out.timings.total_seconds >= out.timings.forward_seconds > 0
    (logprobs,) = out.logprobs
    assert logprobs.table.num_top_logprobs == 2 and len(logprobs.table.token_ids) == 3
    assert list(logprobs.table.ranks) == [1]  # greedy picks the most likely token
    (prompt_logprobs,) = out.prompt_logprobs
    assert list(prompt_logprobs.table.token_ids)[::2] == PROMPT[1:]
    tokens = [out.sampled_token_ids[0]]
    for step_id in (2, 3):
        await call.write(decode_step(step_id, tokens[-1], 4 + step_id - 1))
        out = await read_output(call)
        assert out.status == pb.STEP_STATUS_OK and not out.prompt_logprobs
        tokens.append(out.sampled_token_ids[0])
    await call.write(decode_step(5, tokens[-1], 7))  # step 4 is missing
    gap = await read_output(call)
    assert gap.status == pb.STEP_STATUS_ERROR and "consecutive" in gap.error_message
    await call.write(decode_step(4, tokens[-1], 7))
    after = await read_output(call)
    assert after.status == pb.STEP_STATUS_ERROR and "has failed" in after.error_message
    await call.done_writing()
    return tokens


def test_servicer_lifecycle_over_grpc(worker_checkpoints: CheckpointCache) -> None:
    model = worker_checkpoints.get("llama")
    registry = CollectorRegistry()
    tokens = asyncio.run(scenario(model, registry))
    assert tokens == reference_generate(load_reference(model), PROMPT, 3)
    labels = {"model_name": "tiny", "engine": "e0", "rank": "0"}
    assert registry.get_sample_value("splitserve_worker_steps_total", labels) == 3
    assert registry.get_sample_value("splitserve_worker_kv_blocks_used", labels) == 2


async def failing_steps(model: Path) -> list[pb.ModelRunnerOutput]:
    servicer = WorkerServicer(CollectorRegistry(), StallWatch(lambda is_ready: None), device="cpu")
    server, port = start_server(servicer)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cast("pb_grpc.WorkerServiceAsyncStub", pb_grpc.WorkerServiceStub(channel))
            await stub.LoadModel(load_request(model_path=str(model), block_size=4))
            await stub.InitializeKvCache(pb.InitializeKvCacheRequest(num_blocks=16))
            call = open_stream(stub)
            await call.write(decode_step(1, 3, 5))  # a request this rank never saw
            outputs = [await read_output(call)]
            malformed = decode_step(2, 3, 5)
            malformed.scheduler_output.total_num_scheduled_tokens = 7
            await call.write(malformed)
            outputs.append(await read_output(call))
            await call.write(first_step(3))  # the rank still serves: step 3 runs
            outputs.append(await read_output(call))
            await call.done_writing()
            return outputs
    finally:
        servicer.close()
        server.stop(None)


def test_bad_requests_fail_alone_and_a_malformed_step_is_refused(
    worker_checkpoints: CheckpointCache,
) -> None:
    unknown, malformed, valid = asyncio.run(failing_steps(worker_checkpoints.get("llama")))
    assert unknown.status == pb.STEP_STATUS_OK and list(unknown.failed_req_handles) == [5]
    assert "unknown to this rank" in unknown.failed_reasons[0]
    assert malformed.status == pb.STEP_STATUS_ERROR and malformed.step_id == 2
    assert "malformed step 2" in malformed.error_message
    assert valid.status == pb.STEP_STATUS_OK and list(valid.req_handles) == [5]


def only_token(msg: pb.GrammarBitmask, handle: int, token: int, vocab_size: int) -> None:
    """A sparse grammar mask (core_svc/structured_output/structured_bitmask.py's form) allowing `token` alone."""
    msg.req_handles.append(handle)
    msg.sparse.num_words = (vocab_size + 31) // 32
    msg.sparse.row_defaults = b"\x00"
    msg.sparse.num_listed_words.append(1)
    msg.sparse.word_indices = (token // 32).to_bytes(4, "little")
    msg.sparse.words = (1 << (token % 32)).to_bytes(4, "little", signed=False)


async def constrained_steps(model: Path) -> tuple[int, list[pb.ModelRunnerOutput]]:
    servicer = WorkerServicer(CollectorRegistry(), StallWatch(lambda is_ready: None), device="cpu")
    server, port = start_server(servicer)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cast("pb_grpc.WorkerServiceAsyncStub", pb_grpc.WorkerServiceStub(channel))
            loaded = await stub.LoadModel(load_request(model_path=str(model), block_size=4))
            vocab = loaded.vocab_size
            await stub.InitializeKvCache(pb.InitializeKvCacheRequest(num_blocks=16))
            call = open_stream(stub)
            step = first_step(1)  # the mask with the step
            only_token(step.scheduler_output.grammar_bitmask, 5, vocab - 3, vocab)
            await call.write(step)
            outputs = [await read_output(call)]
            step = decode_step(2, vocab - 3, 5)  # the mask after the step (async scheduling)
            step.scheduler_output.has_pending_grammar = True
            await call.write(step)
            grammar = pb.ExecuteRequest(grammar_output=pb.GrammarOutput(step_id=2))
            only_token(grammar.grammar_output.grammar_bitmask, 5, 40, vocab)
            await call.write(grammar)
            outputs.append(await read_output(call))
            step = decode_step(3, 40, 6)
            only_token(step.scheduler_output.grammar_bitmask, 5, 33, vocab)
            bad_index = (1 << 20).to_bytes(4, "little")
            step.scheduler_output.grammar_bitmask.sparse.word_indices = bad_index
            await call.write(step)  # a malformed mask: refused before the step runs
            outputs.append(await read_output(call))
            step = decode_step(4, 40, 6)
            only_token(step.scheduler_output.grammar_bitmask, 5, 33, vocab)
            await call.write(step)  # the rank still serves
            outputs.append(await read_output(call))
            await call.done_writing()
            return vocab, outputs
    finally:
        servicer.close()
        server.stop(None)


def test_sparse_grammar_masks_steer_sampling_and_a_malformed_one_is_refused(
    worker_checkpoints: CheckpointCache,
) -> None:
    vocab, (inline, deferred, malformed, after) = asyncio.run(
        constrained_steps(worker_checkpoints.get("llama"))
    )
    assert inline.status == pb.STEP_STATUS_OK, inline.error_message
    assert list(inline.sampled_token_ids) == [vocab - 3]
    (logprobs,) = inline.logprobs  # logprobs see the mask: the only allowed token has all
    assert list(logprobs.table.ranks) == [1] and logprobs.table.logprobs[0] == 0.0
    assert deferred.status == pb.STEP_STATUS_OK and list(deferred.sampled_token_ids) == [40]
    assert malformed.status == pb.STEP_STATUS_ERROR and malformed.step_id == 3
    assert "grammar_bitmask.sparse" in malformed.error_message
    assert after.status == pb.STEP_STATUS_OK and list(after.sampled_token_ids) == [33]
